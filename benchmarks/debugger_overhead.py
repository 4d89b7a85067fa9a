"""What the RL debugger costs per trainer step: record + detectors (+ a dump) against collating the same batch.

    python -m benchmarks.debugger_overhead [--rollouts 64,512] [--tokens 1024] [--repeats 5]

For each batch shape, fake groups (1k-token responses) are collated once; then, ``--repeats`` times:
``collate_groups`` (the baseline: work every step already does), ``Debugger.observe`` on a quiet step
(record + detectors + one JSONL line), and ``observe`` on a step whose detectors fire (adds the msgpack
dump of the batch with its provenance). Medians in ms, and the ratio to collate, in JSON under
``benchmarks/results/`` with machine and commit. Single-threaded CPU; the record's quantiles and
histograms run on the CPU whatever the trainer's device.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.config import DebugConfig
from asyncrl.debug.detectors import Debugger
from asyncrl.rollout import Group, Rollout
from benchmarks._report import machine
from datapipes.collate import collate_groups

ROOT = Path(__file__).parents[1]


def groups(rollouts: int, tokens: int, group_size: int = 8) -> list[Group]:
    g = torch.Generator().manual_seed(0)
    out = []
    for p in range(rollouts // group_size):
        rs = [Rollout(epoch=0, prompt_index=p, sample_index=s, worker_id=f"w{p % 4}", policy_version=3,
                      prompt_ids=torch.randint(0, 1000, (64,), generator=g, dtype=torch.int32),
                      response_ids=torch.randint(0, 1000, (tokens,), generator=g, dtype=torch.int32),
                      logprobs=-torch.rand(tokens, generator=g), reward=float(s % 2), timings={"generate": 0.5})
              for s in range(group_size)]
        out.append(Group(epoch=0, prompt_index=p, rollouts=rs))
    return out


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", default="64,512")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for n in map(int, args.rollouts.split(",")):
        gs = groups(n, args.tokens)
        batch = collate_groups(gs)
        trainer = batch["rollout_logprobs"] + 1e-7 * batch["loss_mask"]
        bad = batch["rollout_logprobs"] + 0.5 * batch["loss_mask"]  # an on-policy mismatch: fires and dumps
        with tempfile.TemporaryDirectory() as tmp:
            dbg = Debugger(tmp, 0, DebugConfig(max_dumps=10**6), max_staleness=1, context={"model_dir": "m"})
            step = iter(range(1, 10**6))

            def observe(lp):
                return dbg.observe(step=next(step), policy_version=3, batch=batch, trainer_logprobs=lp,
                                   advantages=torch.zeros(n), accepted=True, guard_reason="", loss=0.1,
                                   grad_norm=1.0, update_ratio=0.01, weights=lambda: [torch.zeros(1000)])

            collate_ms = timed(lambda: collate_groups(gs), args.repeats)
            quiet_ms = timed(lambda: observe(trainer), args.repeats)
            dump_ms = timed(lambda: observe(bad), args.repeats)
            line_bytes = max(len(line) for line in (Path(tmp) / "debug" / "steps-rank0.jsonl").read_bytes().splitlines())
            dbg.close()
        results[str(n)] = {"tokens": int(batch["loss_mask"].sum()), "collate_ms": collate_ms, "observe_ms": quiet_ms,
                           "observe_with_dump_ms": dump_ms, "observe_vs_collate": quiet_ms / collate_ms,
                           "record_line_bytes": line_bytes}
        print(f"{n} rollouts x {args.tokens} tokens: collate {collate_ms:.1f} ms, observe {quiet_ms:.1f} ms "
              f"({quiet_ms / collate_ms:.2f}x collate), with dump {dump_ms:.1f} ms, record line {line_bytes} B")
    out = {"benchmark": "debugger_overhead", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "config": vars(args), "machine": machine(), "metrics": results}
    path = ROOT / "benchmarks" / "results" / f"debugger_overhead-{dt.date.today()}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
