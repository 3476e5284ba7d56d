"""Test-only: a plain-loop run of the harness in its own process, for the tests of many runs on one
namespace (tests/test_replays.py). Real harness, real tensors, real files; nothing mocked.

    python tests/sharing_rig.py DUMP_DIR --steps 6 [--pause 0.3] [--hold] [--follow 30] [--observe] [--lr 0.1]
        [--stop-at N]

Prints `started <reader|recorder>` once its startup is done, `step N <outcome>` after each step, and
`done` at the end; with --hold it then waits for a line on stdin before it closes (it keeps holding the
namespace until then). With --stop-at N it commits step N, prints `committed N` and waits on stdin before
it reports step N's values (a recorder the test kills there). Each mini-batch depends only on (step, inner index): every run generates the
same rollouts, so a reader's own rollouts equal the recorded ones.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from skip_harness.config import RolloutTQConfig
from skip_harness.run.harness import SkipHarness
from skip_harness.run.settings import RunSettings
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import NamespaceKey

KEY = NamespaceKey("exp", "proj", 8, 2, 4, 4, K=1, W=1)


class Loop:
    def __init__(self) -> None:
        self.generated: list = []

    def prepare_data(self, step, *, dispatch=True):
        pass

    def sample(self, step):
        self.generated.append(step)
        g = torch.Generator().manual_seed(10 * step)
        return {"x": torch.randn(64, 32, generator=g), "ids": torch.arange(64) + step}


def make(dump_dir: str, follow: float = 0.0, **kw) -> SkipHarness:
    settings = RolloutTQConfig(enable=True, dump_dir=str(dump_dir), follow_timeout=follow, **kw)
    return SkipHarness(RunSettings(settings, KEY, fingerprint=Fingerprint({"seed": 0})))


def values_for(step: int, lr: float) -> dict:
    """What a 'trainer' reports: it depends on the step and on the training side (lr)."""
    return {"loss": 1.0 / step + lr, "reward_mean": 0.1 * step}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump_dir")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--follow", type=float, default=0.0)
    ap.add_argument("--observe", action="store_true")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--stop-at", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    h = make(args.dump_dir, args.follow)
    h.set_training_config({"lr": args.lr})
    t = Loop()
    h.wrap(t)
    h.start()
    print("started", "reader" if h._startup is not None and h._startup.reader else "recorder", flush=True)
    for step in range(1, args.steps + 1):
        t.prepare_data(step)
        t.sample(step)
        if step == args.stop_at:
            h.commit_finished()
            print("committed", step, flush=True)
            sys.stdin.readline()
        if args.observe:
            h.observe(step, **values_for(step, args.lr))
        h.commit_finished()
        print("step", step, h.outcome(step).value, flush=True)
        time.sleep(args.pause)
    print("done", flush=True)
    if args.hold:
        sys.stdin.readline()
    summary = h.close()
    print("summary", summary.hits, summary.misses, summary.committed, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
