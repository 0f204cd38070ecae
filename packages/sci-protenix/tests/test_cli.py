"""``spore sci-protenix plan``: the table, the JSON (equal to plan/predict_peak), the errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sci_protenix.cli import group
from sci_protenix.planning import Dims, plan, predict_peak, resident_bytes


def invoke(*args: str):
    return CliRunner().invoke(group, ["plan", *args], catch_exceptions=False)


def test_json_is_the_plan_and_its_prediction() -> None:
    result = invoke("--tokens", "512", "--budget", "2GiB", "--training", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    expected = plan(512, "2GiB", training=True)
    assert report["plan"] == expected.model_dump(mode="json")
    assert report["mode"] == "training"
    assert report["budget_bytes"] == 2 * 2**30
    assert report["predicted_peak_bytes"] == predict_peak(512, expected, training=True)
    assert report["resident_bytes"] == resident_bytes(512)
    assert report["total_bytes"] <= report["budget_bytes"]


def test_widths_reach_the_planner() -> None:
    args = ["--tokens", "64", "--budget", "1MiB", "--c-z", "8", "--c-s", "16", "--n-heads", "2"]
    args += ["--pair-heads", "2", "--c-hidden-mul", "8", "--c-hidden-pair-att", "4", "--json"]
    report = json.loads(invoke(*args).output)
    widths = dict(c_z=8, c_s=16, n_heads=2, pair_heads=2, c_hidden_mul=8, c_hidden_pair_att=4)
    assert report["plan"] == plan(64, "1MiB", **widths).model_dump(mode="json")
    assert report["predicted_peak_bytes"] == predict_peak(
        64, plan(64, "1MiB", **widths), dims=Dims(**widths)
    )


def test_the_table_names_each_module_and_the_figures() -> None:
    result = invoke("--tokens", "768", "--budget", "8GiB", "--training")
    assert result.exit_code == 0, result.output
    chosen = plan(768, "8GiB", training=True)
    for line in ("triangle multiplication", "triangle attention", "transitions", "recompute"):
        assert line in result.output
    chunked = next(v for v in (chosen.tri_mul, chosen.tri_att, chosen.transition) if v)
    assert f"{chunked} rows" in result.output
    assert "predicted peak" in result.output
    assert "8.00 GiB" in result.output


def test_a_block_without_a_single_track_shows_no_pair_bias_chunk() -> None:
    result = invoke("--tokens", "512", "--budget", "0.5GiB", "--c-s", "0")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "attention with pair bias" in line)
    assert "none (--c-s 0)" in row


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "3000", "--budget", "1GiB"], "give a budget of at least"),
        # torch's message with its C++ frames
        (["--tokens", "30", "--budget", "8GiB", "--c-z", "9" * 20], "too large to plan"),
        # an OverflowError traceback from the float in format_bytes
        (["--tokens", "1" + "0" * 160, "--budget", "8GiB"], "do not fit in 8.00 GiB"),
        (["--tokens", "8", "--blocks", "1" + "0" * 320, "--budget", "8GiB"], "do not fit"),
    ],
)
def test_errors_are_click_errors(args, message) -> None:
    result = CliRunner().invoke(group, ["plan", *args])
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


SIZES = ["--tokens", "30", "--budget", "1GiB"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # a stray value was answered "Missing option '--tokens'" alone
        (["768"], "'768' is an argument this command does not take"),
        (["768"], "did you mean --tokens 768?"),
        (["--budget", "8GiB", "768"], "did you mean --tokens 768?"),
        (["--tokens", "768", "8GiB"], "did you mean --budget 8GiB?"),
        # the planner's Python names (n_blocks, c_s, ...) were printed, not the options
        ([*SIZES, "--blocks", "0"], "Invalid value for '--blocks': 0 is not in the range x>=1"),
        ([*SIZES, "--batch", "0"], "Invalid value for '--batch'"),
        (["--tokens", "0", "--budget", "1GiB"], "Invalid value for '--tokens'"),
        ([*SIZES, "--c-z", "0"], "Invalid value for '--c-z'"),
        ([*SIZES, "--c-s", "-1"], "Invalid value for '--c-s': -1 is not in the range x>=0"),
        ([*SIZES, "--c-s", "30"], "Invalid value for '--c-s': 30 is not a multiple of --n-heads"),
        ([*SIZES, "--n-heads", "0"], "Invalid value for '--n-heads'"),
        ([*SIZES, "--pair-heads", "0"], "Invalid value for '--pair-heads'"),
        ([*SIZES, "--c-hidden-mul", "0"], "Invalid value for '--c-hidden-mul'"),
        ([*SIZES, "--c-hidden-pair-att", "0"], "Invalid value for '--c-hidden-pair-att'"),
        (["--tokens", "30", "--budget", "lots"], "Invalid value for '--budget': budget 'lots'"),
        # a traceback (float overflow) once
        (["--tokens", "30", "--budget", "9" * 400], "Invalid value for '--budget': budget '99"),
        ([*SIZES, "--device", "gpu0"], "Invalid value for '--device': 'gpu0' is not a torch"),
    ],
)
def test_usage_errors_name_the_options(args, message) -> None:
    result = CliRunner().invoke(group, ["plan", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())  # rich may wrap the line
    assert "Traceback" not in result.output


def test_a_stray_value_the_missing_option_would_refuse_is_not_suggested_for_it() -> None:
    """``plan 8GiB`` suggested ``--tokens 8GiB``, which --tokens then refuses."""
    result = CliRunner().invoke(group, ["plan", "8GiB"])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "'8GiB' is an argument this command does not take (it takes options only)" in output
    assert "did you mean" not in output


def test_an_npu_device_is_taken_without_torch_npu() -> None:
    """torch knows 'npu' only once torch_npu is imported: the device check refused it, though a
    byte budget does not read the device at all."""
    plain = invoke("--tokens", "512", "--budget", "2GiB", "--json")
    for device in ("npu", "npu:1"):
        result = invoke("--tokens", "512", "--budget", "2GiB", "--json", "--device", device)
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) == json.loads(plain.output)


def test_through_the_spore_command(run_spore) -> None:
    done = run_spore("sci-protenix", "plan", "--tokens", "256", "--budget", "1GiB", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["plan"] == plan(256, "1GiB").model_dump(mode="json")
