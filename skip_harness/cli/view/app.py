"""The web app: Starlette routes for the pages and the JSON API behind them.

    /                                   overview (every namespace, as `ls`)     /api/namespaces
    /ns/{key}                           a namespace: steps table, charts        /api/ns/{key}
    /ns/{key}/charts                    its charts over steps (SVG)
    /ns/{key}/step/{n}                  a step (?q= &min_reward= &max_reward= &sort= &order= &color= &page=)
                                                                                /api/ns/{key}/step/{n}
    /ns/{key}/step/{n}/t/{i.r.j}        one trajectory                          /api/ns/{key}/step/{n}/t/{i.r.j}
    /ns/{key}/step/{n}/discarded        what a filter dropped from the step     (the step's JSON: `discarded`)
    /compare?a={key}&b={key}&step={n}   two namespaces at one step, with the diff

`key` is `{root}/{group}/{leaf}`: the root's number on the command line, then the namespace's two names.
Every response says what it is and forbids scripts and framing by other sites (Content-Security-Policy);
requests whose Host is not the address served are refused (DNS rebinding).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Dict, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.concurrency import run_in_threadpool

from skip_harness.cli.view import pages
from skip_harness.cli.view.data import Cache, ViewedNamespace
from skip_harness.cli.view.decode import Decoder
from skip_harness.cli.view.live import REFRESH_S, REFRESH_STEP_S, live
from skip_harness.cli.view.templates import environment
from skip_harness.errors import SkipHarnessError

logger = logging.getLogger("skip_harness.cli.view")

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
                               "frame-src 'self'; form-action 'self'; frame-ancestors 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


FAVICON = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
           b'fill="#1d2330"/><path d="M4 11h8M4 8h5M4 5h8" stroke="#cfe0ff" stroke-width="1.6"/></svg>')


def _json_default(value: Any) -> Any:
    if isinstance(value, float):
        return None
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _Json(JSONResponse):
    def render(self, content: Any) -> bytes:   # NaN and infinities as null: every JSON reader opens it
        return json.dumps(_finite(content), default=_json_default, allow_nan=False, indent=1).encode()


def build_app(cache: Cache, decoder: Decoder, allowed_hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> Starlette:
    env = environment()
    summaries = pages.Summaries()
    pairings = pages.Pairings()

    def html(name: str, ctx: Dict[str, Any], status: int = 200, refresh: int = 0) -> HTMLResponse:
        ctx.setdefault("roots", [str(r) for r in cache.roots])
        ctx["refresh"] = refresh
        headers = dict(_HEADERS, Refresh=str(refresh)) if refresh else _HEADERS
        return HTMLResponse(env.get_template(name).render(**ctx), status_code=status, headers=headers)

    def error(status: int, title: str, message: str, api: bool) -> Response:
        if api:
            return _Json({"error": message}, status_code=status, headers=_HEADERS)
        return html("error", {"title": title, "message": message}, status)

    def ns_of(request: Request) -> ViewedNamespace:
        key = request.path_params["key"]
        ns = cache.namespace(key)
        if ns is None:
            raise pages.NotFound(f"no namespace {key} (the overview lists them)")
        return ns

    def step_of(request: Request) -> int:
        return int(request.path_params["step"])

    def handler(fn, api: bool = False):
        async def endpoint(request: Request) -> Response:
            try:
                return await run_in_threadpool(fn, request)
            except pages.NotFound as exc:
                return error(404, "not found", str(exc), api)
            except pages.BadQuery as exc:
                return error(400, "bad request", str(exc), api)
            except (SkipHarnessError, OSError) as exc:
                logger.warning("%s: %s", request.url.path, exc)
                return error(502, "cannot read the cache", f"{type(exc).__name__}: {exc}", api)
        return endpoint

    # ---- pages

    def overview_page(request: Request) -> Response:
        ctx = pages.overview(cache)
        rows = ctx["rows"]
        ctx.update(ns_rows=rows, pick_a=rows[0]["key"] if rows else "",
                   pick_b=rows[1]["key"] if len(rows) > 1 else "", pick_step=1)
        return html("overview", ctx, refresh=REFRESH_S if any(r["live"].refreshing for r in rows) else 0)

    def namespace_page(request: Request) -> Response:
        ctx = pages.namespace(cache, ns_of(request), summaries, pages.ChartQuery.from_params(request.query_params))
        return html("namespace", ctx, refresh=REFRESH_S if ctx["live"].refreshing else 0)

    def charts_page(request: Request) -> Response:
        return html("charts", pages.namespace_charts(cache, ns_of(request), summaries,
                                                     pages.ChartQuery.from_params(request.query_params)))

    def step_page(request: Request) -> Response:
        query = pages.StepQuery.from_params(request.query_params)
        ctx = pages.step_page(cache, ns_of(request), step_of(request), query, decoder)
        return html("step", ctx, refresh=REFRESH_STEP_S if ctx["live"].refreshing else 0)

    def trajectory_page(request: Request) -> Response:
        return html("trajectory", pages.trajectory(cache, ns_of(request), step_of(request),
                                                   request.path_params["ref"], decoder,
                                                   request.query_params.get("color", "")))

    def discarded_page(request: Request) -> Response:
        ctx = pages.discarded_page(cache, ns_of(request), step_of(request))
        return html("discarded", ctx, refresh=REFRESH_STEP_S if ctx["live"].refreshing else 0)

    def bad_step(request: Request) -> Response:
        raise pages.BadQuery(f"step {request.path_params['step']!r} is not a step number")

    def favicon(request: Request) -> Response:
        return Response(FAVICON, media_type="image/svg+xml", headers=_HEADERS)

    def compare_page(request: Request) -> Response:
        a, b, step = _compare_args(request)
        ctx = pages.compare(cache, a, b, step, decoder, pairings, *_compare_view(request))
        diff = cache.diff(a, b, ctx["scans"])
        ctx["diff"] = None if diff is None else json.dumps(_finite(diff), indent=1, default=str)
        ctx.update(pages.diff_at(diff, step))
        return html("compare", ctx)

    def _compare_view(request: Request):
        p = request.query_params
        page, only = p.get("page", "1"), p.get("only", "")
        if not (page.isdigit() and int(page) > 0):
            raise pages.BadQuery(f"page={page!r}: a page is a number from 1")
        if only not in ("", "differ"):
            raise pages.BadQuery(f"only={only!r}: only=differ shows the pairs that differ, nothing else is known")
        return int(page), only

    def _compare_args(request: Request):
        p = request.query_params
        listed = {ns.key: ns for ns in cache.namespaces()}          # listed once for both
        a, b = listed.get(p.get("a", "")), listed.get(p.get("b", ""))
        if a is None or b is None:
            raise pages.NotFound(f"compare needs two namespaces: a={p.get('a', '')!r} b={p.get('b', '')!r}")
        step = p.get("step", "")
        if not step.isdigit():
            raise pages.BadQuery(f"compare needs a step number, got step={step!r}")
        return a, b, int(step)

    # ---- the JSON API

    def api_namespaces(request: Request) -> Response:
        return _Json(pages.overview_json(cache), headers=_HEADERS)

    def api_namespace(request: Request) -> Response:
        ns = ns_of(request)
        return _Json(dict(cache.namespace_doc(ns), live=live(cache, ns).to_json()), headers=_HEADERS)

    def api_step(request: Request) -> Response:
        return _Json(pages.step_json(cache, ns_of(request), step_of(request),
                                     request.query_params.get("compare_run", "")[:200]), headers=_HEADERS)

    def api_trajectory(request: Request) -> Response:
        ctx = pages.trajectory(cache, ns_of(request), step_of(request), request.path_params["ref"], decoder)
        t, s = ctx["traj"], ctx["shown"]
        return _Json({"ref": t.ref, "inner_index": t.inner, "rank": t.rank, "trajectory_index": t.index,
                      "group": t.group, "reward": t.reward, "rewards_by": t.rewards_by, "advantage": t.advantage,
                      "length": t.length,
                      "advantage_computed": ctx["advantage_computed"], "prompt_text": s.prompt_text,
                      "prompt_tokens": s.prompt_tokens, "response_text": s.response_text,
                      "response_tokens": s.response_tokens,
                      "per_token": {r.name: r.values for r in s.token_rows}, "fields": s.fields}, headers=_HEADERS)

    def api_compare(request: Request) -> Response:
        a, b, step = _compare_args(request)
        ctx = pages.compare(cache, a, b, step, decoder, pairings)
        pairing = ctx["pairing"]
        doc: Dict[str, Any] = {
            "step": step, "a": a.key, "b": b.key, "differs": pages.DIFFERS, "notes": ctx["notes"],
            "sides": [{"key": s["ns"].key, "status": s["read"].status, "reason": s["read"].reason,
                       "summary": s["summary"]} for s in ctx["sides"]],
            "diff": cache.diff(a, b, ctx["scans"])}
        if pairing is not None:
            doc.update(paired_by=pairing.by, same=pairing.same, differ=pairing.differ, only_in_a=pairing.only_a,
                       only_in_b=pairing.only_b,
                       trajectories=[{"identity": p.identity, "ref_a": p.a.ref if p.a else None,
                                      "ref_b": p.b.ref if p.b else None, "reward_a": p.a.reward if p.a else None,
                                      "reward_b": p.b.reward if p.b else None, "same": p.same,
                                      "first_difference": p.first}
                                     for p in pairing.pairs])
        return _Json(doc, headers=_HEADERS)

    routes = [
        Route("/", handler(overview_page)),
        Route("/favicon.ico", favicon),
        Route("/compare", handler(compare_page)),
        Route("/ns/{key:path}/step/{step:int}/t/{ref}", handler(trajectory_page)),
        Route("/ns/{key:path}/step/{step:int}/discarded", handler(discarded_page)),
        Route("/ns/{key:path}/step/{step:int}", handler(step_page)),
        Route("/ns/{key:path}/step/{step}/t/{ref}", handler(bad_step)),
        Route("/ns/{key:path}/step/{step}", handler(bad_step)),
        Route("/ns/{key:path}/charts", handler(charts_page)),
        Route("/ns/{key:path}", handler(namespace_page)),
        Route("/api/namespaces", handler(api_namespaces, True)),
        Route("/api/compare", handler(api_compare, True)),
        Route("/api/ns/{key:path}/step/{step:int}/t/{ref}", handler(api_trajectory, True)),
        Route("/api/ns/{key:path}/step/{step:int}", handler(api_step, True)),
        Route("/api/ns/{key:path}", handler(api_namespace, True)),
    ]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))]
    return Starlette(routes=routes, middleware=middleware)

