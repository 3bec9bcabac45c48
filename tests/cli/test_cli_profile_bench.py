"""`fitdqn plan --calibrate`, `fitdqn profile`, `fitdqn bench`: help, CPU behaviour, the profile writer and rule."""

import json

import pytest
import torch
from support.benchmarks import load_benchmark

from fitdqn.cli import build_parser, main
from fitdqn.device.profiles import load_profiles, match_profile, parse_profile
from fitdqn.errors import UserError
from fitdqn.train.profile import (
    choose_batch,
    match_pattern,
    power_of_two_batches,
    print_profile,
    profile_config,
    profile_name,
    profile_toml,
    write_profile,
)

TINY = [
    "--market.data", "synthetic", "--market.synthetic_bars", "1200", "--market.episode_length", "32",
    "--net.window", "4", "--net.trunk_hidden", "64", "--net.d_model", "32", "--net.stream_hidden", "32",
    "--net.num_atoms", "11", "--net.iqn_embedding", "16", "--net.iqn_quantiles", "8", "--net.iqn_act_quantiles", "8",
    "--net.iql_hidden", "32", "--collect.num_envs", "16", "--replay.capacity", "4096", "--replay.min_fill", "128",
    "--train.sample_reuse", "1", "--train.device", "cpu",  # the device last: the CUDA tests drop it (TINY[:-2])
]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def subcommand_help(name: str) -> str:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return commands.choices[name].format_help()


def test_help_documents_calibrate_profile_and_bench():
    top = build_parser().format_help()
    assert "profile" in top and "bench" in top
    plan = subcommand_help("plan")
    assert "--calibrate" in plan and "--calibrate-batches" in plan and "measured per-sample" in plan
    profile = subcommand_help("profile")
    for option in ("--batches", "--epochs-per-batch", "--name", "--out", "within 5 %", "fitdqn profile --name h200"):
        assert option in profile, option
    bench = subcommand_help("bench")
    for option in ("--json", "--iters", "--collect-steps", "--seconds", "samples/s", "env steps/s",
                   "--collect.num_envs 64"):
        assert option in bench, option


@no_cuda
def test_plan_calibrate_on_cpu_is_a_clear_error(capsys):
    assert main(["plan", "--calibrate", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--calibrate measures the step on a CUDA GPU; this machine has none" in err
    assert "Traceback" not in err
    assert main(["plan", "--calibrate"]) == 2  # device auto: the CPU here
    assert "this machine has none" in capsys.readouterr().err


def test_plan_calibrate_refuses_a_what_if_gpu(capsys):
    assert main(["plan", "--calibrate", "--gpu", "h100"]) == 2
    assert "--gpu" in capsys.readouterr().err


@no_cuda
def test_profile_on_cpu_is_a_clear_error(capsys, tmp_path):
    assert main(["profile", "--out", str(tmp_path / "p.toml")]) == 2
    err = capsys.readouterr().err
    assert "fitdqn profile measures step time on a CUDA GPU; this machine has none" in err
    assert "Traceback" not in err and not (tmp_path / "p.toml").exists()


def rows() -> list[dict]:
    samples = {64: 1000.0, 128: 1900.0, 256: 3000.0, 512: 3100.0, 1024: 3050.0}
    return [{"batch": b, "update_ms": b / 100, "epoch_samples_per_s": s, "env_steps_per_s": 5e5,
             "peak_bytes": 2**30 + b * 400_000} for b, s in samples.items()]


def test_choose_batch_is_the_smallest_within_5_percent_of_the_best():
    assert choose_batch(rows()) == 256  # best 3100 at 512; 3000 >= 0.95 x 3100
    assert choose_batch(rows(), tolerance=0.0) == 512
    assert choose_batch(rows(), tolerance=0.5) == 128  # 1900 >= 1550
    failed = [{"batch": 8192, "error": "out of memory"}, {"batch": 4096, "epoch_samples_per_s": None}]
    assert choose_batch(rows() + failed) == 256
    with pytest.raises(UserError, match="no batch size"):
        choose_batch(failed)


def test_power_of_two_batches():
    assert power_of_two_batches(64, 1000) == [64, 128, 256, 512]
    assert power_of_two_batches(100, 1024) == [128, 256, 512, 1024]
    assert power_of_two_batches(64, 64) == [64]
    assert power_of_two_batches(64, 100) == [64]
    assert power_of_two_batches(64, 50) == []


def test_profile_names_from_the_card():
    assert profile_name("NVIDIA H200") == "h200"
    assert profile_name("NVIDIA GeForce RTX 3050 Laptop GPU") == "rtx-3050-laptop-gpu"
    assert match_pattern("NVIDIA H100 80GB HBM3") == "^NVIDIA H100 80GB HBM3$"


def test_profile_written_from_measurements_parses_back_and_matches_the_card(tmp_path):
    source = {"kind": "measured", "description": "measured by `fitdqn profile` on NVIDIA H200", "date": "2026-11-29",
              "command": "fitdqn profile --name h200", "card": "NVIDIA H200", "driver": "570.86.15",
              "torch": "2.11.0", "cuda": "12.8", "num_envs": 4096, "cuda_graphs": True}
    measured = rows() + [{"batch": 2048, "error": "out of memory"}]
    chosen = choose_batch(measured)
    text = profile_toml("h200", "NVIDIA H200", chosen, 150_754_820_096, source,
                        [r for r in measured if "error" not in r], driver_bytes=312_000_000)
    assert text.startswith("# fitdqn GPU profile: NVIDIA H200")
    path = write_profile(tmp_path / "profiles" / "h200.toml", text)
    profile = parse_profile(path.read_text(), str(path))
    assert profile.name == "h200" and profile.batch_size == 256
    assert profile.total_memory_bytes == 150_754_820_096 and profile.driver_bytes == 312_000_000
    assert profile.source["kind"] == "measured" and profile.source["card"] == "NVIDIA H200"
    assert [m["batch"] for m in profile.measurements] == [64, 128, 256, 512, 1024]
    first = profile.measurements[0]
    assert set(first) == {"batch", "update_ms", "epoch_samples_per_s", "env_steps_per_s", "peak_bytes"}
    assert first["update_ms"] == pytest.approx(0.64) and first["peak_bytes"] == 2**30 + 64 * 400_000
    profiles = load_profiles(path.parent)
    assert match_profile("NVIDIA H200", profiles).name == "h200"
    assert match_profile("NVIDIA H200 NVL", profiles).name == "default"  # another card: profile it separately


def test_profile_writer_refuses_what_the_parser_would_not_read(tmp_path):
    bad = profile_toml("x", "Card", 256, None, {"description": "no date"}, [])
    with pytest.raises(UserError, match="date"):
        write_profile(tmp_path / "x.toml", bad)
    assert not (tmp_path / "x.toml").exists()


def test_profile_config_shortens_epochs_unless_given():
    from fitdqn.config import Config

    assert profile_config(Config(), steps_given=False).collect.steps_per_epoch == 16
    assert profile_config(Config(), steps_given=True).collect.steps_per_epoch == Config().collect.steps_per_epoch
    assert profile_config(Config(), steps_given=False).budget.batch_size == 0


def test_profile_command_flow_on_cpu(tmp_path, monkeypatch, capsys):
    """The measuring runs on any device; only the command asks for CUDA: with that check stubbed, the whole
    command runs on the CPU (rows, the rule, the file, the table)."""
    import fitdqn.plan.calibrate

    monkeypatch.setattr(fitdqn.plan.calibrate, "require_cuda", lambda device, what="": None)
    out = tmp_path / "profiles" / "cpu.toml"
    args = ["profile", *TINY, "--batches", "128,64", "--epochs-per-batch", "1", "--update-iters", "2",
            "--name", "cpu-test", "--out", str(out), "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    measured = record["rows"]
    assert [r["batch"] for r in measured] == [64, 128]
    for row in measured:
        assert row["update_ms"] > 0 and row["epoch_samples_per_s"] > 0 and row["env_steps_per_s"] > 0
        assert row["epoch_updates"] == max(1, -(-16 * 16 // row["batch"]))  # 16 envs x 16 steps (shortened)
        assert row["peak_bytes"] is None  # no allocator statistics on the CPU
    assert record["batch_size"] == choose_batch(measured)
    assert record["source"]["steps_per_epoch"] == 16 and record["source"]["command"].startswith("fitdqn profile")
    profile = parse_profile(out.read_text(), str(out))
    assert profile.name == "cpu-test" and profile.batch_size == record["batch_size"]
    assert len(profile.measurements) == 2 and "peak_bytes" not in profile.measurements[0]
    print_profile(measured, record["batch_size"], "cpu test")
    assert "chosen" in capsys.readouterr().out


def test_bench_on_cpu_reports_positive_throughputs(capsys):
    args = ["bench", "--json", *TINY, "--batch-size", "64", "--iters", "3", "--collect-steps", "3", "--seconds", "1"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "cpu" and result["batch_size"] == 64 and result["num_envs"] == 16
    assert result["graphs"] is False
    assert set(result["update"]) == set(result["replay"]) == set(result["collector"]) == {"eager"}
    for key in ("updates_per_s", "samples_per_s", "ms"):
        assert result["update"]["eager"][key] > 0
    assert result["update"]["eager"]["samples_per_s"] == pytest.approx(64 * result["update"]["eager"]["updates_per_s"])
    assert result["replay"]["eager"]["samples_per_s"] > 0 and result["replay"]["eager"]["iters_per_s"] > 0
    assert result["collector"]["eager"]["env_steps_per_s"] > 0
    assert 1 <= result["update"]["eager"]["calls"] <= 3


def test_bench_table_on_cpu(capsys):
    assert main(["bench", *TINY, "--batch-size", "64", "--iters", "1", "--collect-steps", "1", "--seconds", "1"]) == 0
    out = capsys.readouterr().out
    assert "update" in out and "replay" in out and "collector" in out and "env steps/s" in out


def load_sweep():
    return load_benchmark("budget_sweep")


def test_budget_sweep_pure_parts(capsys):
    sweep = load_sweep()
    config = sweep.sweep_config(["collect.num_envs=1024"])
    assert config.budget.batch_size == 0 and config.collect.num_envs == 1024
    assert sweep.steps_for_batch(config, 50_000) == 49 + config.learn.n_step + 2
    assert sweep.steps_for_batch(config, 64) == max(8, 10 + config.learn.n_step + 2)  # min_fill 10000
    row = {"ooms": 0}
    logger = sweep.CountingLogger(row)
    logger.log(1, "epoch", {})
    logger.log(1, "oom", {"old_batch": 512, "new_batch": 256})
    assert row["ooms"] == 1 and row["oom_events"][0]["old_batch"] == 512
    sweep.print_table([
        {"card_gib": 4, "status": "ok", "planned_batch": 900, "largest_batch": 950, "batch_ratio": 900 / 950,
         "ooms": 0, "planned_bytes": 3.5 * 2**30, "allocator_peak_bytes": 3.4 * 2**30, "peak_error": -0.03,
         "free_drop_bytes": 3.6 * 2**30, "free_drop_error": 0.03, "wall_seconds": 40, "pass_ooms": True,
         "pass_peak": True, "pass_batch": True},
        {"card_gib": 1.7, "status": "refused by the planner", "error": "the fixed consumers need ..."},
    ])
    out = capsys.readouterr().out
    assert "0.947" in out and "refused" in out and "OOMs zero: True" in out


@no_cuda
def test_budget_sweep_without_cuda_exits_cleanly(capsys):
    assert load_sweep().main(["--cards", "4"]) == 2
    assert "this machine has none" in capsys.readouterr().err


@needs_cuda
def test_bench_on_cuda_has_graphed_rows(capsys):
    args = ["bench", "--json", *TINY[:-2], "--collect.num_envs", "256", "--batch-size", "256", "--iters", "5"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["graphs"] is True
    for part in ("update", "replay", "collector"):
        assert set(result[part]) == {"eager", "graphed"}


@needs_cuda
def test_profile_on_cuda_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "p.toml"
    args = ["profile", *TINY[:-2], "--collect.num_envs", "256", "--batches", "64,128", "--epochs-per-batch", "1",
            "--update-iters", "3", "--name", "test-gpu", "--out", str(out)]
    assert main(args) == 0
    profile = parse_profile(out.read_text(), str(out))
    assert profile.name == "test-gpu" and profile.batch_size in (64, 128)
    assert profile.source["kind"] == "measured" and len(profile.measurements) == 2
