"""The latency-under-arrivals check of `servelab bench --calibrate`: the served-step fit,
the per-step overhead in the fitted CPU profile, and the held-out table (tiny runs: the
machinery, not the fit's quality, which is measured on a quiet machine)."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from servelab.bench.sim.calibrate import StepTimer, threads_of
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import CPU_HERE_TERMS, Accelerator, StepTerms, accelerator
from servelab.bench.sim.latency_check import (CHUNKED, CONTINUOUS, FIT, HELD_OUT, LATENCY_FIGURES, LatencyCase,
                                              ServedRun, admitted_between, busy_after, check_latency, default_cases,
                                              fit_served, format_latency, latency_profile, scaled)
from servelab.bench.sim.shapes import model_shape
from servelab.cli import main
from servelab.config import EngineConfig

_TERMS = StepTerms(step_s=1e-3, sequence_s=1e-3)


def _features(num_seqs: int) -> dict[str, float]:
    return {"step": 1.0, "sequence": float(num_seqs), "prefill_gemm_flop": 0.0, "decode_gemm_flop": 0.0,
            "prefill_attention_flop": 0.0, "decode_kv_byte": 0.0, "lm_head_flop": 0.0}


def _served(sizes: list[int], speed: float, overhead: float, idle_after: int | None = None,
            admitted: list[int] | None = None, admission: float = 0.0,
            stalls: dict[int, float] | None = None) -> ServedRun:
    starts, now = [], 0.0
    admitted = admitted or [0] * len(sizes)
    for index, size in enumerate(sizes):
        starts.append(now)
        now += speed * _TERMS.seconds(_features(size)) + overhead + admission * admitted[index]
        now += (stalls or {}).get(index, 0.0)  # a thread preempted by other work
        if index == idle_after:
            now += 0.5  # the engine waits for the next arrival
    busy = [index != idle_after for index in range(len(sizes))]
    return ServedRun(record=None, steps=[(size, 0.0) for size in sizes], starts=starts, busy=busy, admitted=admitted)


def test_busy_after_tells_a_step_followed_by_work_from_one_followed_by_a_wait():
    steps = [(None, 1.0), (None, 1.0), (None, 1.0)]
    # one request from 0 to 2 (it finishes as the second step ends), the next arrives at 5
    spans = [(0.0, 2.0), (5.0, 7.0)]
    assert busy_after([0.0, 1.0, 5.0], steps, spans) == [True, False, True]


def test_fit_served_recovers_speed_and_overhead_and_leaves_out_waits_for_arrivals():
    run = _served([1, 4, 2, 8, 3, 6, 5, 7, 2, 4] * 3, speed=1.6, overhead=2e-3, idle_after=5)
    fit = fit_served([run], _TERMS, _features)
    assert fit.speed == pytest.approx(1.6, rel=1e-6)
    assert fit.step_overhead_s == pytest.approx(2e-3, rel=1e-6)
    assert fit.admission_s == 0.0 and max(abs(r) for r in fit.residuals_s) < 1e-9


def test_fit_served_prices_each_request_admitted_between_two_steps():
    sizes = [1, 4, 2, 8, 3, 6, 5, 7, 2, 4] * 3
    admitted = [0, 1, 0, 2, 0, 0, 1, 3, 0, 1] * 3
    fit = fit_served([_served(sizes, speed=1.3, overhead=1e-3, admitted=admitted, admission=4e-4)], _TERMS, _features)
    assert (fit.speed, fit.step_overhead_s, fit.admission_s) == pytest.approx((1.3, 1e-3, 4e-4), rel=1e-6)


def test_fit_served_leaves_stalls_out_of_the_fit_and_keeps_them_as_step_noise():
    sizes = [1, 4, 2, 8, 3, 6, 5, 7, 2, 4] * 6
    stalls = {7: 0.02, 23: 0.03, 41: 0.02}  # three steps whose thread was preempted
    fit = fit_served([_served(sizes, speed=1.6, overhead=2e-3, stalls=stalls)], _TERMS, _features)
    assert fit.speed == pytest.approx(1.6, rel=1e-6) and fit.step_overhead_s == pytest.approx(2e-3, rel=1e-6)
    assert sorted(fit.residuals_s)[-3:] == pytest.approx([0.02, 0.02, 0.03], rel=1e-6)
    plain = fit_served([_served(sizes, speed=1.6, overhead=2e-3)], _TERMS, _features)
    assert plain.speed == pytest.approx(1.6, rel=1e-6)


def test_fit_served_takes_the_wake_up_from_the_steps_after_a_wait():
    run = _served([1, 4, 2, 8, 3, 6, 5, 7, 2, 4] * 3, speed=1.6, overhead=2e-3, idle_after=5)
    durations = [1.6 * _TERMS.seconds(_features(size)) + (7e-4 if index == 6 else 0.0)
                 for index, (size, _) in enumerate(run.steps)]
    run = attrs.evolve(run, steps=[(size, d) for (size, _), d in zip(run.steps, durations)])
    fit = fit_served([run], _TERMS, _features)
    assert fit.wake_s == pytest.approx(7e-4, rel=1e-6) and fit.woken_s == pytest.approx((7e-4,), rel=1e-6)


def test_a_simulated_step_after_a_wait_pays_the_profiles_wake_up():
    from servelab.bench.sim.runner import SimInputs, SimRunner, VirtualClock

    clock = VirtualClock()
    runner = SimRunner(CostModel(model_shape("tiny-random"),
                                 latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1, wake_s=1e-3)), clock)
    inputs = SimInputs([1] * 4, [40] * 4, [0, 1, 2, 3], [1] * 4)
    runner.execute(inputs)
    busy = clock() - 0.0
    clock.advance_to(clock() + 0.5)  # the engine waited for an arrival
    before = clock()
    runner.execute(inputs)
    assert clock() - before == pytest.approx(busy + 1e-3)
    before = clock()
    runner.execute(inputs)
    assert clock() - before == pytest.approx(busy)


def test_the_wake_up_is_fitted_as_a_line_in_the_log_of_the_wait_through_group_medians():
    from servelab.bench.sim.latency_check import WAKE_GROUPS, fit_wake

    waits = [0.002 * 1.5 ** i for i in range(6 * WAKE_GROUPS)]
    woken = [2e-4 + 4e-4 * math.log(wait) + 3e-3 for wait in waits]
    woken[5] += 0.05  # a slow wake-up in the tail: one group's median does not feel it
    a, b = fit_wake(waits, woken)
    assert (a, b) == pytest.approx((2e-4 + 3e-3, 4e-4), rel=0.05)
    assert fit_wake(waits, [1e-3] * len(waits)) is None  # flat: the median model stays
    assert fit_wake(waits[:WAKE_GROUPS], woken[:WAKE_GROUPS]) is None  # too few to group


def test_a_simulated_wake_up_grows_with_the_wait_it_follows():
    from servelab.bench.sim.runner import SimInputs, SimRunner, VirtualClock

    clock = VirtualClock()
    profile = latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1, wake_s=1e-3, wake_log=(5e-3, 1e-3))
    runner = SimRunner(CostModel(model_shape("tiny-random"), profile), clock)
    inputs = SimInputs([1] * 4, [40] * 4, [0, 1, 2, 3], [1] * 4)
    runner.execute(inputs)
    busy = clock()
    taken = []
    for wait in (0.01, 0.1, 1.0):
        clock.advance_to(clock() + wait / 2)
        clock.advance_to(clock() + wait / 2)  # two waits in a row count as one
        before = clock()
        runner.execute(inputs)
        taken.append(clock() - before - busy)
    assert taken == pytest.approx([max(0.0, 5e-3 + 1e-3 * math.log(w)) for w in (0.01, 0.1, 1.0)])
    assert profile.wake_after(0.0) == 1e-3  # no wait measured: the median


def test_the_wake_ups_spread_about_the_line_is_kept_per_group_of_waits():
    from servelab.bench.sim.latency_check import WAKE_GROUPS, fit_wake, wake_spread

    waits = [0.002 * 1.5 ** i for i in range(6 * WAKE_GROUPS)]
    woken = [4e-3 + 1e-3 * math.log(wait) for wait in waits]
    woken[-2] += 0.02  # the longest waits' group has a slow wake-up in its tail
    line = fit_wake(waits, woken)
    spread = wake_spread(waits, woken, line)
    assert len(spread) == WAKE_GROUPS and [longest for longest, _ in spread] == sorted(waits)[5::6]
    assert all(len(group) == 6 for _, group in spread)
    assert max(spread[-1][1]) == pytest.approx(0.02, abs=1e-3)  # the tail stays in its own group
    assert all(max(map(abs, group)) < 1e-3 for _, group in spread[:-1])
    assert wake_spread(waits, woken, None) == ()


def test_a_simulated_wake_up_draws_from_the_spread_of_its_wait_group():
    import random

    spread = ((0.1, (0.0,)), (1.0, (0.004, 0.008)))
    profile = latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1, wake_s=1e-3, wake_log=(5e-3, 1e-3),
                              wake_spread=spread)
    draws = random.Random(0)
    line = lambda wait: 5e-3 + 1e-3 * math.log(wait)  # noqa: E731
    assert profile.wake_after(0.05, draws) == pytest.approx(line(0.05))  # the short waits' group: no spread
    long_waits = {round(profile.wake_after(0.5, draws) - line(0.5), 6) for _ in range(50)}
    assert long_waits == {0.004, 0.008}
    assert round(profile.wake_after(30.0, draws) - line(30.0), 6) in {0.004, 0.008}  # past the last group: the last
    assert profile.wake_after(0.5) == pytest.approx(line(0.5))  # no draws: the line


def test_fit_served_never_gives_a_negative_speed_on_a_handful_of_steps():
    # bigger steps followed sooner by the next: least squares alone would give a negative speed
    run = ServedRun(record=None, steps=[(1, 0.0), (1, 0.0), (8, 0.0), (1, 0.0), (2, 0.0)],
                    starts=[0.0, 0.004, 0.010, 0.012, 0.018], busy=[True] * 5)
    fit = fit_served([run], _TERMS, _features)
    assert fit.speed == 1.0 and fit.step_overhead_s >= 0 and fit.admission_s >= 0


def test_admitted_between_counts_the_arrivals_before_each_next_step():
    assert admitted_between([0.0, 1.0, 2.0], [0.5, 0.7, 1.5, 3.0]) == [2, 1, 0]
    assert admitted_between([], [1.0]) == []


def test_fit_served_with_steps_all_alike_puts_the_difference_in_the_overhead():
    fit = fit_served([_served([3] * 12, speed=1.0, overhead=1e-3)], _TERMS, _features)
    assert fit.speed * _TERMS.seconds(_features(3)) + fit.step_overhead_s == pytest.approx(5e-3, rel=1e-6)
    assert fit.step_overhead_s >= 0


def test_the_cpu_profile_adds_its_per_step_overhead_to_the_fitted_terms():
    shape = model_shape("tiny-random")
    base = CostModel(shape, accelerator("cpu-here"))
    served = CostModel(shape, latency_profile(CPU_HERE_TERMS, 2.0, 3e-3, threads=2))
    step = ([1] * 4, [40] * 4, 4)
    assert served.step(*step).seconds == pytest.approx(2 * base.step(*step).seconds + 3e-3)
    assert accelerator("cpu-here").threads == 1 and served.hardware.threads == 2
    assert scaled(CPU_HERE_TERMS, 2.0).step_s == pytest.approx(2 * CPU_HERE_TERMS.step_s)


def test_a_served_profile_charges_admissions_to_the_step_that_starts_the_prompts():
    shape = model_shape("tiny-random")
    plain = CostModel(shape, latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1))
    admitting = CostModel(shape, latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1, admission_s=5e-4))
    starting = ([30, 20, 1], [30, 20, 41], 3)  # two prompts start, one sequence decodes
    assert admitting.step(*starting).seconds == pytest.approx(plain.step(*starting).seconds + 2 * 5e-4)
    later_chunk = ([30], [60], 1)
    assert admitting.step(*later_chunk).seconds == pytest.approx(plain.step(*later_chunk).seconds)


def test_simulated_steps_draw_the_profiles_step_noise_the_same_way_every_run():
    from servelab.bench.sim.runner import SimInputs, SimRunner, VirtualClock

    shape = model_shape("tiny-random")
    noise = (0.0, 0.0, 0.0, 0.01)

    def step_times(profile):
        clock = VirtualClock()
        runner = SimRunner(CostModel(shape, profile), clock)
        times = []
        for _ in range(400):
            before = clock()
            runner.execute(SimInputs([1] * 4, [40] * 4, [0, 1, 2, 3], [1] * 4))
            times.append(clock() - before)
        return times

    quiet = step_times(latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1))
    noisy = step_times(latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1, step_noise_s=noise))
    assert noisy == step_times(latency_profile(CPU_HERE_TERMS, 1.0, 0.0, threads=1, step_noise_s=noise))
    stalled = sum(1 for n, q in zip(noisy, quiet) if n == pytest.approx(q + 0.01))
    assert 60 < stalled < 140 and all(n == pytest.approx(q) or n == pytest.approx(q + 0.01)
                                      for n, q in zip(noisy, quiet))


def test_threads_of_sets_and_restores_torchs_thread_count():
    before = torch.get_num_threads()
    with threads_of(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_step_timer_keeps_each_steps_start_on_the_engines_clock():
    timer = StepTimer(clock=iter([10.0, 10.5]).__next__)
    timer.recording = True

    class Engine:
        @staticmethod
        def clock():
            return 7.0

    timer.servelab_step_started(Engine())
    timer._shape = "shape"
    timer.servelab_step_finished(Engine(), None)
    assert timer.timed == [("shape", 0.5)] and timer.starts == [7.0]


def test_default_plan_holds_out_rates_past_saturation_bursts_chunked_prefill_and_another_kind():
    cases = default_cases(60)
    fit = [c for c in cases if c.role == FIT]
    held = [c for c in cases if c.role == HELD_OUT]
    assert fit and all(c.overrides == CONTINUOUS and "seed=0" in c.workload for c in fit)
    assert cases[0].role == cases[-1].role == FIT  # the fit brackets the held-out cases in time
    assert all("seed=1" in c.workload for c in held)
    assert any("rate=24" in c.workload for c in held)
    assert any("arrival=bursty" in c.workload for c in held)
    assert any(c.overrides == CHUNKED for c in held)
    assert any(c.workload.startswith("long-burst") for c in held)


def test_check_latency_fits_on_fit_cases_and_reports_every_figure_of_the_held_out_ones():
    config = EngineConfig().with_overrides({"engine.max_model_len": 128})
    small = "skewed:num_requests=4,mean_prompt_len=12,mean_output_len=4,max_len=64"
    cases = [LatencyCase("fit", f"{small},arrival=poisson,rate=200,seed=0", CONTINUOUS, FIT),
             LatencyCase("bursty", f"{small},arrival=bursty,rate=200,burst_size=2,seed=1", CONTINUOUS, HELD_OUT),
             LatencyCase("chunked", f"{small},arrival=poisson,rate=200,seed=1", {**CHUNKED,
                         "engine.max_num_batched_tokens": 8}, HELD_OUT)]
    result = check_latency(config, CPU_HERE_TERMS, _tiny_features(config), cases, threads=1)
    assert result["fit_cases"] == ["fit"] and set(result["held_out"]) == {"bursty", "chunked"}
    assert result["speed"] > 0 and result["step_overhead_s"] >= 0 and result["admission_s"] >= 0
    assert result["step_noise_ms"]["count"] >= 0 and result["wake_ms"]["count"] >= 0
    for row in result["held_out"].values():
        assert set(row) == set(LATENCY_FIGURES)
        for cell in row.values():
            assert cell["measured"] is not None and cell["simulated"] is not None
            if cell["measured"]:
                assert cell["error"] == pytest.approx(abs(cell["simulated"] - cell["measured"]) / cell["measured"])
    table = format_latency(result)
    assert "bursty" in table and "chunked" in table and "median error" in table


def _tiny_features(config: EngineConfig):
    from servelab.bench.sim.calibrate import step_features

    return step_features(config)


def test_calibrate_refuses_a_bad_thread_count(capsys):
    assert main(["bench", "--calibrate", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_a_fitted_cpu_profile_simulates_the_configs_dtype_and_kv_pool_as_the_real_engine_sizes_them():
    from servelab.bench.sim.runner import VirtualClock
    from servelab.bench.sim.source import SimSource

    config = EngineConfig().with_overrides({"engine.max_model_len": 512})
    source = SimSource.named("tiny-random", "cpu-here", VirtualClock())
    fitted = source.fit_config(config)
    assert fitted.engine.num_kv_blocks is None and fitted.engine.max_model_len == 512  # engine_setup sizes them
    assert source.dtype_bytes == 4 and source.cost_model.dtype_bytes == 4  # the config's float32
    gpu = SimSource.named("tiny-random", "h100", VirtualClock())
    assert gpu.fit_config(config).engine.num_kv_blocks is not None and gpu.dtype_bytes == 2


def test_calibrate_command_prints_and_returns_the_held_out_latency_table(capsys):
    from servelab.cli import _calibrate

    config = EngineConfig().with_overrides({"engine.max_model_len": 512})
    small = "skewed:num_requests=3,mean_prompt_len=12,mean_output_len=4,max_len=64"
    cases = [LatencyCase("fit 300/s", f"{small},arrival=poisson,rate=300,seed=0", CONTINUOUS, FIT),
             LatencyCase("held 600/s", f"{small},arrival=poisson,rate=600,seed=1", CONTINUOUS, HELD_OUT)]
    result = _calibrate(config, small, threads=1, latency_requests=3, repeats=1, latency_cases=cases)
    out = capsys.readouterr().out
    assert result["threads"] == 1 and result["repeats"] == 1 and result["latency"]["threads"] == 1
    assert list(result["latency"]["held_out"]) == ["held 600/s"]
    assert "fitted cpu terms" in out and "latency under arrivals" in out and "held 600/s" in out
