"""The pages' HTML: Jinja2 templates with autoescaping on, so every value from a cache -- rollouts are
untrusted text -- is escaped. Only the server's own SVG charts are marked safe (charts.py escapes
what it puts in them). No script: sorting, filtering and search are query parameters, so every view is
a plain URL."""
from __future__ import annotations

from jinja2 import DictLoader, Environment, select_autoescape
from markupsafe import Markup

from skip_harness.cli.view.style import CSS, adv_colour, colour, fmt, histogram_svg, legend_html, per_token_html, tokens_html

BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{% block title %}{% endblock %} · skip-harness view</title>
<style>{{ css }}</style></head>
<body><header><a href="/" class="brand">skip-harness view</a>
<span class="crumbs">{% block crumbs %}{% endblock %}</span></header>
<main>{% block main %}{% endblock %}</main></body></html>"""

OVERVIEW = """{% extends "base" %}{% block title %}cache{% endblock %}
{% block main %}
<h1>Rollout cache</h1>
<p class="roots">{% for r in roots %}<span class="root">[{{ loop.index0 }}] {{ r }}</span>{% endfor %}</p>
{% if not rows %}<p class="empty">No skip_harness namespaces here yet.</p>{% else %}
<table id="namespaces" class="grid-table"><thead><tr><th>namespace</th><th>K</th><th>W</th><th>mode</th><th>seed</th>
{% for s in statuses %}<th>{{ s }}</th>{% endfor %}<th>size</th><th>last written</th><th>gen stored</th></tr></thead><tbody>
{% for r in rows %}<tr><td><a class="ns-link" href="/ns/{{ r.key }}">{% if roots|length > 1 %}[{{ r.root_index }}] {% endif %}{{ r.label }}</a>{% if r.live.recording %} <span class="rec" title="{{ r.live.recording.describe() }}">● recording</span>{% endif %}{% if r.live.replays %} <span class="facts small">{{ r.live.replays|length }} replaying</span>{% endif %}</td>
<td class="num">{{ r.K }}</td><td class="num">{{ r.W }}</td><td>{{ r.mode }}</td><td class="num">{{ r.seed }}</td>
{% for s in statuses %}<td class="num status-{{ s }}{% if r.counts[s] %} nonzero{% endif %}">{{ r.counts[s] }}</td>{% endfor %}
<td class="num">{{ r.size }}</td><td>{{ r.written }}</td><td class="num">{{ r.gen }}</td></tr>{% endfor %}
</tbody></table>
<p id="totals" class="totals">{{ total }}</p>{% endif %}
{% if refresh %}<p class="facts small" id="refreshing">a namespace is being recorded: this page refreshes every {{ refresh }} s while it runs</p>{% endif %}
{% if ns_rows|length >= 2 %}{% include "compare_form" %}{% endif %}
{% endblock %}"""

COMPARE_FORM = """<form class="compare-form" action="/compare" method="get"><b>compare</b>
<select name="a">{% for r in ns_rows %}<option value="{{ r.key }}"{% if r.key == pick_a %} selected{% endif %}>{% if roots|length > 1 %}[{{ r.root_index }}] {% endif %}{{ r.label }}</option>{% endfor %}</select>
with <select name="b">{% for r in ns_rows %}<option value="{{ r.key }}"{% if r.key == pick_b %} selected{% endif %}>{% if roots|length > 1 %}[{{ r.root_index }}] {% endif %}{{ r.label }}</option>{% endfor %}</select>
at step <input name="step" type="number" min="0" value="{{ pick_step }}" size="5"> <button type="submit">compare</button></form>"""

NAMESPACE = """{% extends "base" %}{% block title %}{{ ns.label }}{% endblock %}
{% block crumbs %}/ <a href="/ns/{{ ns.key }}">{{ ns.label }}</a>{% endblock %}
{% block main %}
<h1>{{ ns.label }}</h1>
<p class="facts">{{ doc.path }} · K={{ doc.K }} W={{ doc.W }} · mode {{ mode }} · seed {{ seed }} ·
{% for s, n in doc.counts.items() %}{{ n }} {{ s }}{% if not loop.last %}, {% endif %}{% endfor %} · {{ size }}
· <a href="/api/ns/{{ ns.key }}">JSON</a></p>
{% if note %}<p class="note">{{ note }}</p>{% endif %}
{% include "live" %}
<form id="chart-picker" class="controls" method="get" action="/ns/{{ ns.key }}">
<label>search the recorded values <input name="q" value="{{ query.q }}" placeholder="loss, reward, kl ..."></label>
{% if ns_rows|length >= 2 %}<label>overlay runs <select name="with" multiple size="2">{% for r in ns_rows %}{% if r.key != ns.key %}<option value="{{ r.key }}"{% if r.key in runs %} selected{% endif %}>{% if roots|length > 1 %}[{{ r.root_index }}] {% endif %}{{ r.label }}</option>{% endif %}{% endfor %}</select></label>{% endif %}
{% if compare_runs %}<label>action=compare run <select name="compare_run" id="compare-run">{% for r in compare_runs|reverse %}<option value="{{ r.run }}"{% if r.run == compare_run %} selected{% endif %}>{{ r.run }}{% if loop.first %} (newest){% endif %}</option>{% endfor %}</select></label>{% endif %}
<button type="submit">chart</button> <a href="/ns/{{ ns.key }}">defaults</a>
<details id="value-keys"><summary>every recorded value ({{ key_count }}): pick any to chart (charted ones ticked)</summary>
{% for prefix, keys in value_groups %}<fieldset class="key-group"><legend class="mono">{{ prefix }}</legend>{% for k in keys %}<label class="mono key"><input type="checkbox" name="k" value="{{ k }}"{% if k in charted %} checked{% endif %}> {{ k }}</label> {% endfor %}</fieldset>{% endfor %}
</details></form>
<iframe id="charts" src="{{ charts_src }}" title="charts over steps" loading="eager" style="height:{{ (190 + chart_extra) * chart_rows + 30 }}px"></iframe>
{% if ns_rows|length >= 2 %}{% include "compare_form" %}{% endif %}
<table id="steps" class="grid-table"><thead><tr><th>step</th><th>status</th><th>size</th><th>written</th><th>gen</th><th title="groups whose samples all got the same reward: no GRPO signal (charted steps; - not read yet)">dead groups</th><th>fingerprint</th><th>reason</th></tr></thead><tbody>
{% for s in steps %}<tr class="status-{{ s.status }}"><td class="num"><a class="step-link" href="/ns/{{ ns.key }}/step/{{ s.step }}">{{ s.step }}</a></td>
<td>{{ s.status }}</td><td class="num">{{ s.size }}</td><td>{{ s.written }}</td><td class="num">{{ s.gen }}</td>
<td class="num dead-cell">{% if s.dead and s.dead[0] %}<a href="/ns/{{ ns.key }}/step/{{ s.step }}?groups=dead" class="dead-some">{{ s.dead[0] }} ({{ (100 * s.dead[1])|round|int }}%)</a>{% elif s.dead %}0{% else %}-{% endif %}</td>
<td class="mono">{{ s.fingerprint or "-" }}</td><td class="reason">{{ s.reason or "" }}</td></tr>{% endfor %}
</tbody></table>
{% endblock %}"""

CHARTS = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>charts</title><style>{{ css }}</style></head>
<body class="charts-frame">
{% for svg in charts %}{{ svg|safe }}{% endfor %}
{% if note %}<p class="note">{{ note }}</p>{% endif %}
</body></html>"""



STEP = """{% extends "base" %}{% block title %}{{ ns.label }} step {{ step }}{% endblock %}
{% block crumbs %}/ <a href="/ns/{{ ns.key }}">{{ ns.label }}</a> / step {{ step }}{% endblock %}
{% block main %}
<nav class="stepnav">{% if prev is not none %}<a id="prev" href="/ns/{{ ns.key }}/step/{{ prev }}">← step {{ prev }}</a>{% endif %}
<h1>step {{ step }}</h1>{% if next is not none %}<a id="next" href="/ns/{{ ns.key }}/step/{{ next }}">step {{ next }} →</a>{% endif %}
<a href="/api/ns/{{ ns.key }}/step/{{ step }}">JSON</a></nav>
{% include "live" %}
{% if discarded %}<p class="facts" id="discarded-link"><a class="discarded-some" href="/ns/{{ ns.key }}/step/{{ step }}/discarded">{{ discarded }} group{{ "s" if discarded != 1 }} discarded</a> by a filter before training (not in this step's rollouts): which, and why</p>{% endif %}
{% if read.reason %}<div id="refused" class="refused status-{{ read.status }}"><b>{{ read.status }}</b>: {{ read.reason }}
<p>The viewer shows only steps that pass the verified read; nothing of this step's payload is shown.</p></div>
{% else %}
<p id="summary" class="facts">{{ read.status }} · {{ summary.trajectories }} trajectories in {{ summary.groups }} groups ·
{% if summary.dead_group_share is not none %}<a id="dead-count" class="{{ 'dead-some' if summary.dead_group_count else '' }}" href="{{ filter_url('dead') }}">{{ summary.dead_group_count }} dead group{{ "s" if summary.dead_group_count != 1 }}</a> ({{ (100 * summary.dead_group_share)|round|int }}%: every sample the same reward, no GRPO signal) ·{% endif %}
reward mean {{ fmt(summary.reward_mean) }} ± {{ fmt(summary.reward_std) }} (min {{ fmt(summary.reward_min) }}, max {{ fmt(summary.reward_max) }}) ·
length mean {{ fmt(summary.length_mean) }}, max {{ fmt(summary.length_max) }}{% if table.advantage_computed %} · advantages computed (GRPO: group-normalised reward){% endif %}
{% if decoder_name %} · decoded with {{ decoder_name }}{% endif %}</p>
{% if rewards %}<p class="facts">rewards {{ histogram_svg(rewards) }}</p>{% endif %}
{% if reward_note %}<p class="note" id="reward-note">{{ reward_note }}</p>{% endif %}
{% if ids_only %}{% include "ids_hint" %}{% endif %}
{% if table.reward_functions %}<p class="facts" id="reward-source">rewards from the step's second tier: {{ table.reward_functions|join(", ") }}{% if table.reward_functions|length > 1 %} (reward: their sum, unweighted){% endif %}</p>{% endif %}
{% if recorded %}<details id="recorded" class="fold"{% if reward_note %} open{% endif %}><summary>the step's recorded values ({{ recorded|length }})</summary>
<div class="values-grid">{% for k, v in recorded %}<div class="value"><span class="mono key">{{ k }}</span> <span class="num">{{ v }}</span></div>{% endfor %}</div></details>{% endif %}
{% include "drift" %}
<table id="minibatches" class="grid-table small"><thead><tr><th>inner index</th><th>rank</th><th>trajectories</th><th>generation</th><th>fields</th></tr></thead><tbody>
{% for mb in minibatches %}<tr><td class="num">{{ mb.inner }}</td><td class="num">{{ mb.rank }}</td><td class="num">{{ mb.n }}</td><td class="num">{{ mb.gen }}</td><td class="mono">{{ mb.fields }}</td></tr>{% endfor %}
</tbody></table>
<form id="controls" class="controls" method="get" action="/ns/{{ ns.key }}/step/{{ step }}">
<label>search <input name="q" value="{{ q }}" placeholder="text, token ids or group"></label>
<label>reward ≥ <input name="min_reward" value="{{ min_reward }}" size="6"></label>
<label>≤ <input name="max_reward" value="{{ max_reward }}" size="6"></label>
<label>sort <select name="sort">{% for k in sort_keys %}<option{% if k == sort %} selected{% endif %}>{{ k }}</option>{% endfor %}</select></label>
<label>order <select name="order">{% for k in ("asc", "desc") %}<option{% if k == order %} selected{% endif %}>{{ k }}</option>{% endfor %}</select></label>
{% if colour_keys %}<label>colour <select name="color">{% for k in colour_keys %}<option{% if k == color %} selected{% endif %}>{{ k }}</option>{% endfor %}</select></label>{% endif %}
<label>groups <select name="groups" id="group-filter">{% for v, label in (("", "all"), ("dead", "dead only"), ("live", "with signal only")) %}<option value="{{ v }}"{% if v == group_filter %} selected{% endif %}>{{ label }}</option>{% endfor %}</select></label>
<button type="submit">apply</button> <a href="/ns/{{ ns.key }}/step/{{ step }}">reset</a></form>
{{ legend_html(legend) }}
<p class="facts" id="shown">{{ shown_count }} of {{ summary.trajectories }} trajectories shown{% if pages > 1 %} · page {{ page }} of {{ pages }}
{% if page > 1 %}<a href="{{ page_url(page - 1) }}">previous page</a>{% endif %} {% if page < pages %}<a href="{{ page_url(page + 1) }}">next page</a>{% endif %}{% endif %}</p>
{% for group, members in groups %}<section class="group{% if group in dead %} dead{% endif %}" data-group="{{ group }}"><h3>group <span class="mono uid">{{ group }}</span> · {{ members|length }} sample{{ "s" if members|length != 1 }}{% if group in dead %} <span class="dead-badge" title="every sample of this prompt got the same reward: GRPO's advantages are all zero">dead: every sample reward {{ fmt(members[0].traj.reward) }}, no GRPO signal</span>{% endif %}</h3>
{% set first = members[0] %}<div class="prompt"><span class="label">prompt</span>
{% if first.shown.prompt_text is not none %}<pre class="text">{{ first.shown.prompt_text }}</pre>{% elif first.shown.prompt_tokens is not none %}{{ tokens_html(first.shown.prompt_tokens) }}{% else %}<span class="empty">no prompt stored</span>{% endif %}
{% if first.shown.prompt_folded %}<details class="fold"><summary>… {{ first.shown.prompt_folded }} more prompt tokens ({{ first.shown.prompt_tokens|length + first.shown.prompt_folded }} in all{% if first.shown.prompt_padding %}, {{ first.shown.prompt_padding }} padding dropped{% endif %})</summary><div class="rest">{{ first.shown.prompt_rest }}</div></details>
{% elif first.shown.prompt_tokens is not none %}<span class="facts small">{{ first.shown.prompt_tokens|length }} tokens{% if first.shown.prompt_padding %} ({{ first.shown.prompt_padding }} padding dropped){% endif %}</span>{% endif %}</div>
{% set funcs = table.reward_functions if table.reward_functions|length > 1 else [] %}<table class="samples grid-table"><thead><tr><th>trajectory</th><th>reward</th>{% for f in funcs %}<th class="mono small">{{ f }}</th>{% endfor %}<th>advantage</th><th>length</th><th>response</th></tr></thead><tbody>
{% for t in members %}<tr class="sample" data-ref="{{ t.traj.ref }}"><td><a class="traj-link" href="/ns/{{ ns.key }}/step/{{ step }}/t/{{ t.traj.ref }}">{{ t.traj.ref }}</a>{% if drift and drift.first_difference and t.traj.ref in drift.first_difference %}{% set fd = drift.first_difference[t.traj.ref] %}<br><span class="drift-badge {{ 'same' if fd is none else 'differs' }}" title="generated again by action=compare run {{ drift.run }}">{% if fd is none %}identical when generated again{% else %}generated again: differs from token {{ fd }}{% endif %}</span>{% endif %}</td>
<td class="num reward">{{ fmt(t.traj.reward) }}</td>{% for f in funcs %}<td class="num">{{ fmt((t.traj.rewards_by or {}).get(f)) }}</td>{% endfor %}{% set a = 0.0 if t.traj.advantage_zero else t.traj.advantage %}<td class="num advantage" style="color:{{ adv_colour(a) }}">{{ fmt(a) }}</td><td class="num">{{ t.traj.length if t.traj.length is not none else "-" }}</td>
<td class="response">{% if t.shown.response_text is not none %}<pre class="text">{{ t.shown.response_text }}</pre>{% endif %}
{% if t.shown.response_tokens is not none %}{{ tokens_html(t.shown.response_tokens, t.colour_row, t.shown.masked, drift.first_difference.get(t.traj.ref) if drift and drift.first_difference else none) }}{% endif %}
{% if t.shown.truncated %}<details class="fold"><summary>… {{ t.shown.truncated }} more tokens ({{ t.shown.response_real }} in all{% if t.shown.response_padding %}, padding dropped{% endif %})</summary><div class="rest">{{ t.shown.rest }}</div>
<a class="more" href="/ns/{{ ns.key }}/step/{{ step }}/t/{{ t.traj.ref }}">coloured, with every per-token value</a></details>{% endif %}</td></tr>{% endfor %}
</tbody></table></section>{% endfor %}
{% endif %}
{% endblock %}"""

TRAJECTORY = """{% extends "base" %}{% block title %}{{ ns.label }} step {{ step }} {{ traj.ref }}{% endblock %}
{% block crumbs %}/ <a href="/ns/{{ ns.key }}">{{ ns.label }}</a> / <a href="/ns/{{ ns.key }}/step/{{ step }}">step {{ step }}</a> / {{ traj.ref }}{% endblock %}
{% block main %}
<nav class="trajnav">{% if prev_ref %}<a id="prev-traj" href="/ns/{{ ns.key }}/step/{{ step }}/t/{{ prev_ref }}{% if asked_color %}?color={{ asked_color|urlencode }}{% endif %}">← {{ prev_ref }}</a>{% endif %}
<h1>step {{ step }}, trajectory {{ traj.ref }}</h1>{% if next_ref %}<a id="next-traj" href="/ns/{{ ns.key }}/step/{{ step }}/t/{{ next_ref }}{% if asked_color %}?color={{ asked_color|urlencode }}{% endif %}">{{ next_ref }} →</a>{% endif %}
<span class="facts">{{ position }} of {{ count }}</span></nav>
<p id="traj-facts" class="facts">inner index {{ traj.inner }} · rank {{ traj.rank }} · index {{ traj.index }} · group <span class="mono">{{ traj.group }}</span> ·
{% if dead %}<span class="dead-badge" id="dead-group">dead group: every sample the same reward</span> · {% endif %}reward <b id="reward">{{ fmt(traj.reward) }}</b>{% if traj.rewards_by %} <span id="rewards-by" class="small">({% for f, v in traj.rewards_by.items() %}{{ f }} {{ fmt(v) }}{{ ", " if not loop.last }}{% endfor %}; the second tier's)</span>{% endif %} {% set a = 0.0 if traj.advantage_zero else traj.advantage %}· advantage <b id="advantage" style="color:{{ adv_colour(a) }}">{{ fmt(a) }}</b>{% if advantage_computed %} (computed){% endif %} · length <b id="length">{{ traj.length }}</b>
{% if decoder_name %} · decoded with {{ decoder_name }}{% endif %}</p>
{% if ids_only %}{% include "ids_hint" %}{% endif %}
<h2>prompt{% if shown.prompt_tokens is not none %} <span class="facts small">{{ shown.prompt_tokens|length }} tokens{% if shown.prompt_padding %} ({{ shown.prompt_padding }} padding dropped){% endif %}</span>{% endif %}</h2>
{% if shown.prompt_text is not none %}<pre id="prompt-text" class="text">{{ shown.prompt_text }}</pre>
{% elif shown.prompt_tokens is not none %}{% if shown.prompt_tokens|length > 128 %}<div id="prompt-tokens">{{ tokens_html(shown.prompt_tokens[:64]) }}
<details class="fold"><summary>… {{ shown.prompt_tokens|length - 64 }} more prompt tokens</summary>{{ tokens_html(shown.prompt_tokens[64:]) }}</details></div>
{% else %}<div id="prompt-tokens">{{ tokens_html(shown.prompt_tokens) }}</div>{% endif %}{% endif %}
<h2>response{% if shown.response_real is not none %} <span class="facts small">{{ shown.response_real }} tokens{% if shown.response_padding %} ({{ shown.response_padding }} padding dropped){% endif %}</span>{% endif %}</h2>
{% if shown.response_text is not none %}<pre id="response-text" class="text">{{ shown.response_text }}</pre>{% endif %}
{% if colour_keys %}<form class="controls" method="get"><label>colour <select name="color">{% for k in colour_keys %}<option{% if k == color %} selected{% endif %}>{{ k }}</option>{% endfor %}</select></label> <button type="submit">apply</button></form>{% endif %}
{{ legend_html(colour_row) }}
{% if shown.response_tokens is not none %}<div id="response-tokens">{{ tokens_html(shown.response_tokens, colour_row, shown.masked) }}</div>{% endif %}
{% if shown.token_rows %}<h2>per token</h2><details class="fold" id="per-token-values"><summary>every per-token value, a row per token ({{ shown.response_tokens|length if shown.response_tokens else 0 }} rows)</summary>
{{ per_token_html(shown) }}</details>{% endif %}
<h2>other fields</h2><table id="fields" class="grid-table small"><tbody>
{% for k, v in shown.fields.items() %}<tr><th class="mono">{{ k }}</th><td class="mono">{{ v }}</td></tr>{% endfor %}</tbody></table>
{% endblock %}"""

COMPARE = """{% extends "base" %}{% block title %}compare step {{ step }}{% endblock %}
{% block crumbs %}/ compare step {{ step }}{% endblock %}
{% block main %}
<h1>compare at step {{ step }}</h1>
{% for n in notes %}<p class="note shape-note">{{ n }}</p>{% endfor %}
{% include "compare_form" %}
<div class="side-by-side">{% for side in sides %}<section class="side" id="side-{{ loop.index0 }}">
<h2><a href="/ns/{{ side.ns.key }}/step/{{ step }}">{% if roots|length > 1 %}[{{ side.ns.root_index }}] {% endif %}{{ side.ns.label }}</a></h2>
{% if side.read.reason %}<p class="refused"><b>{{ side.read.status }}</b>: {{ side.read.reason }}</p>
{% else %}<p class="facts">{{ side.summary.trajectories }} trajectories · K={{ side.ns.layout.K }} W={{ side.ns.layout.W }} · reward mean {{ fmt(side.summary.reward_mean) }} ± {{ fmt(side.summary.reward_std) }} · length mean {{ fmt(side.summary.length_mean) }}</p>{% endif %}
</section>{% endfor %}</div>
{% if pairing %}<h2>trajectories</h2>
<p id="diff-summary" class="facts">{{ pairing.same }} pairs identical, {{ pairing.differ }} differ{% if pairing.only_a %}, {{ pairing.only_a }} only in A{% endif %}{% if pairing.only_b %}, {{ pairing.only_b }} only in B{% endif %} (paired by {{ pairing.by }} and sample index)</p>
<p id="differs-means" class="facts small">{{ differs }}.</p>
<p class="facts">{% if only == "differ" %}<a href="{{ page_url(1)|replace('&only=differ', '') }}">show every pair</a>{% else %}<a id="only-differ" href="/compare?a={{ pick_a|urlencode }}&amp;b={{ pick_b|urlencode }}&amp;step={{ step }}&amp;only=differ">show only the pairs that differ</a>{% endif %}
{% if pages > 1 %} · page {{ page }} of {{ pages }} {% if page > 1 %}<a id="prev-page" href="{{ page_url(page - 1) }}">previous page</a>{% endif %} {% if page < pages %}<a id="next-page" href="{{ page_url(page + 1) }}">next page</a>{% endif %}{% endif %}</p>
<table id="diff" class="grid-table samples"><thead><tr><th>pair</th><th>reward A</th><th>reward B</th><th>state</th><th class="first-diff-at">first differing token</th><th>response A</th><th>response B</th></tr></thead><tbody>
{% for r in rows %}<tr class="{{ 'same' if r.same else 'differs' }}"><td class="mono">{{ r.identity }}<br>{% if r.ref_a %}<a href="/ns/{{ sides[0].ns.key }}/step/{{ step }}/t/{{ r.ref_a }}">A {{ r.ref_a }}</a>{% endif %} {% if r.ref_b %}<a href="/ns/{{ sides[1].ns.key }}/step/{{ step }}/t/{{ r.ref_b }}">B {{ r.ref_b }}</a>{% endif %}</td>
<td class="num">{{ fmt(r.reward_a) }}</td><td class="num">{{ fmt(r.reward_b) }}</td><td>{{ r.state }}</td>
<td class="num first-diff-at">{{ "-" if r.first_difference is none else r.first_difference }}</td>
{% for side, m, text in (("a", r.mark_a, r.text_a), ("b", r.mark_b, r.text_b)) %}<td class="response mono">{% if m %}{% if m.skipped %}<span class="folded">… {{ m.skipped }} tokens …</span> {% endif %}{{ m.before }} <mark class="first-diff" id="diff-{{ side }}-{{ r.identity }}" title="first differing token: {{ r.first_difference }}">{{ m.mark if m.mark is not none else "⟨ends⟩" }}</mark> {{ m.after }}{% if m.more > 0 %} … {{ m.more }} more tokens ({{ m.real }} in all){% endif %}{% else %}{{ text }}{% endif %}</td>{% endfor %}</tr>{% endfor %}</tbody></table>{% endif %}
{% if diff is not none %}<h2>recorded values and config (skip-harness diff)</h2>
<p id="diff-verdict" class="facts">{% if diff_pair.first_divergence %}recorded values first diverge at step {{ diff_pair.first_divergence.step }}: {{ diff_pair.first_divergence.key }} {{ fmt(diff_pair.first_divergence.a) }} vs {{ fmt(diff_pair.first_divergence.b) }}{% else %}recorded values the same on the {{ diff_pair.steps_compared }} steps both recorded{% endif %}
{% if diff_pair.steps_only_in_a %} · steps only in A: {{ diff_pair.steps_only_in_a }}{% endif %}{% if diff_pair.steps_only_in_b %} · steps only in B: {{ diff_pair.steps_only_in_b }}{% endif %}
{% if diff_pair.keys_only_in_a %} · recorded in A only (not compared): {{ diff_pair.keys_only_in_a|join(", ") }}{% endif %}{% if diff_pair.keys_only_in_b %} · recorded in B only (not compared): {{ diff_pair.keys_only_in_b|join(", ") }}{% endif %}</p>
{% if diff_pair.config %}<table id="diff-config" class="grid-table small"><thead><tr><th>training-side key</th><th>A</th><th>B</th></tr></thead><tbody>
{% for c in diff_pair.config %}<tr><td class="mono">{{ c.key }}</td><td class="mono">{{ c.a }}</td><td class="mono">{{ c.b }}</td></tr>{% endfor %}</tbody></table>{% endif %}
<details><summary>the whole document (<code>skip-harness diff --json</code>, rollouts by their commit records only)</summary><pre id="diff-doc" class="text">{{ diff }}</pre></details>{% endif %}
{% endblock %}"""

LIVE = """{% if live.recording or live.replays or live.elsewhere %}<div class="live" id="live">
{% if live.recording %}<p id="recording"><b class="rec">● recording</b> by {{ live.recording.describe() }}{% if live.recording.alive is none %} (a run on another host: whether it still runs cannot be checked from here){% endif %}{% if refresh %} · this page refreshes every {{ refresh }} s while it runs{% endif %}</p>{% endif %}
{% for r in live.replays %}<p class="replaying"><b>replaying</b>: run <span class="mono">{{ r.run_id }}</span>, {{ r.describe() }}</p>{% endfor %}
{% if live.elsewhere %}<p class="facts small" id="replays-elsewhere">{{ live.elsewhere }} replay{{ "s" if live.elsewhere != 1 }} recorded here from other hosts (whether they still run cannot be told from this host)</p>{% endif %}
</div>{% endif %}"""

DRIFT = """{% if compare_runs %}<section id="drift" class="drift"><h2>generated again (action=compare)</h2>
{% if drift %}{% set f = drift.figures %}<p class="facts" id="drift-step">run <span class="mono">{{ drift.run }}</span>{% if f.trajectories %}: {{ f.identical|int }} of {{ f.trajectories|int }} trajectories identical ({{ fmt(100 * f.identical_share) }}%){% if f.first_diff_token is defined %}, first differing token {{ f.first_diff_token|int }}{% else %}, no differing token{% endif %}{% if f.max_logprob_diff is defined %}, largest log-prob difference {{ fmt(f.max_logprob_diff) }} on the shared prefix{% endif %}{% else %}: no figures for this step{% endif %}</p>
{% if drift.note %}<p class="note">{{ drift.note }}</p>{% endif %}{% else %}<p class="facts" id="drift-step">run <span class="mono">{{ compare_run }}</span> compared no trajectories at this step (the recording's step, or the run's, was missing, or they could not be paired)</p>{% endif %}
{% if compare_runs|length > 1 %}<p class="facts small" id="compare-runs">{{ compare_runs|length }} compare runs: {% for r in compare_runs %}{% if r.run == compare_run %}<b class="mono">{{ r.run }}</b>{% else %}<a class="mono" href="/ns/{{ ns.key }}/step/{{ step }}?compare_run={{ r.run|urlencode }}">{{ r.run }}</a>{% endif %}{{ " · " if not loop.last }}{% endfor %}</p>{% endif %}
</section>{% endif %}"""

IDS_HINT = """<p class="note" id="tokenizer-hint">token ids shown: no tokenizer was given and these rollouts store no
text. Start the viewer with <code>--tokenizer NAME_OR_PATH</code> (a local tokenizer directory, a tokenizer.json, or a
name in the local Hugging Face cache) to read them as text.</p>"""

DISCARDED = """{% extends "base" %}{% block title %}{{ ns.label }} step {{ step }} discarded{% endblock %}
{% block crumbs %}/ <a href="/ns/{{ ns.key }}">{{ ns.label }}</a> / <a href="/ns/{{ ns.key }}/step/{{ step }}">step {{ step }}</a> / discarded{% endblock %}
{% block main %}
<nav class="stepnav">{% if prev is not none %}<a id="prev" href="/ns/{{ ns.key }}/step/{{ prev }}/discarded">← step {{ prev }}</a>{% endif %}
<h1>step {{ step }}: discarded groups</h1>{% if next is not none %}<a id="next" href="/ns/{{ ns.key }}/step/{{ next }}/discarded">step {{ next }} →</a>{% endif %}
<a href="/api/ns/{{ ns.key }}/step/{{ step }}">JSON</a></nav>
{% include "live" %}
{% if not rows %}<p class="empty" id="none-discarded">Nothing was recorded as discarded from this step (no filter dropped a group, or the trainer does not report it).</p>
{% else %}<p id="discarded-summary" class="facts">{{ rows|length }} group{{ "s" if rows|length != 1 }} discarded{% if samples %} ({{ samples }} samples with rewards){% endif %} before training: generated, then dropped; the step's <a href="/ns/{{ ns.key }}/step/{{ step }}">rollouts</a> are the groups kept.</p>
<table id="reasons" class="grid-table small"><thead><tr><th>reason</th><th>groups</th></tr></thead><tbody>
{% for reason, n in reasons %}<tr><td>{{ reason }}</td><td class="num">{{ n }}</td></tr>{% endfor %}</tbody></table>
<table id="discarded" class="grid-table"><thead><tr><th>group</th><th>reason</th><th>samples</th><th>rewards</th></tr></thead><tbody>
{{ rows_html }}
</tbody></table>{% endif %}
{% endblock %}"""

ERROR = """{% extends "base" %}{% block title %}{{ title }}{% endblock %}
{% block main %}<h1>{{ title }}</h1><p class="refused">{{ message }}</p><p><a href="/">back to the cache</a></p>{% endblock %}"""


def environment() -> Environment:
    env = Environment(loader=DictLoader({"base": BASE, "overview": OVERVIEW, "compare_form": COMPARE_FORM,
                                         "namespace": NAMESPACE, "charts": CHARTS, "step": STEP,
                                         "trajectory": TRAJECTORY, "compare": COMPARE, "error": ERROR,
                                         "ids_hint": IDS_HINT, "drift": DRIFT, "live": LIVE,
                                         "discarded": DISCARDED}),
                      autoescape=select_autoescape(default=True, default_for_string=True))
    env.globals.update(css=Markup(CSS), colour=colour, adv_colour=adv_colour, fmt=fmt,
                       tokens_html=tokens_html, legend_html=legend_html, histogram_svg=histogram_svg,
                       per_token_html=per_token_html)   # our own stylesheet
    return env
