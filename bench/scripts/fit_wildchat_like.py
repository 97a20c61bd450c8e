"""Fit (and check) the wildchat-like generator against the paper's WildChat statistics.

Prints, for seeded samples of conversations, the mean turn count and the P90 of
the Turn 2+ prompt context (message tokens under the word rule); the paper
reports 3.1 turns and P90 ~ 5,115 tokens. With --scale it shows how a size
scale moves the P90, which is how the medians in workloads.py were chosen.

    python bench/scripts/fit_wildchat_like.py --n 20000 --scale 0.9 1.0 1.1
"""

from __future__ import annotations

import argparse

from ppd_router.bench.metrics import percentile
from ppd_router.bench.workloads import WildChatLikeWorkload, summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, nargs="*", default=[1.0])
    args = ap.parse_args()
    for scale in args.scale:
        s = summarize(WildChatLikeWorkload(args.seed, scale).conversations(args.n))
        print(f"scale={scale:g} conversations={s.conversations} avg_turns={s.avg_turns:.3f} "
              f"turn2plus_ctx_p50={percentile(s.turn2plus_context, 50):.0f} "
              f"p90={percentile(s.turn2plus_context, 90):.0f}")


if __name__ == "__main__":
    main()
