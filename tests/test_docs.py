"""The documentation's examples run, and the Sphinx site builds without a warning."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import RELIABILITY_MESSAGES, load_example, run_command

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
PAGES = [
    "index", "quickstart", "bring_your_own_model", "strategy", "architecture", "configuration", "layouts",
    "tensor_parallel", "partitioning", "wavefront",
    "timeline", "reliability", "gpu", "data", "language_models", "generation", "benchmarks", "results", "api",
    "dependencies", "when_to_use", "changelog",
]


@pytest.mark.timeout(120)
def test_single_process_example_trains():
    loss = load_example("single_process").main()
    assert math.isfinite(loss) and 0 < loss < 10


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_pipeline_two_ranks_example_runs_as_a_script():
    result = run_command([sys.executable, str(EXAMPLES / "pipeline_two_ranks.py")], timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    found = re.findall(r"^final loss: (\S+)$", result.stdout, flags=re.MULTILINE)
    assert len(found) == 1, result.stdout[-4000:]  # printed once, on rank 0
    assert math.isfinite(float(found[0]))


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_auto_layout_example_ranks_once_and_trains_the_pick():
    result = run_command([sys.executable, str(EXAMPLES / "auto_layout.py")], timeout=280)
    assert result.returncode == 0, result.stdout[-4000:]
    assert len(re.findall(r"^mp_lstm: layout=auto ranked \d+ layouts", result.stdout, flags=re.MULTILINE)) == 1
    chosen = re.findall(r"^(.+?)  +\d+ +\d+ .* chosen$", result.stdout, flags=re.MULTILINE)
    found = re.findall(r"^trained on (\d) process\(es\); final loss: (\S+)$", result.stdout, flags=re.MULTILINE)
    assert len(chosen) == 1 and len(found) == 1, result.stdout[-4000:]  # ranked and reported once, on rank 0
    processes = 1 if chosen[0].startswith("1 process") else 2
    assert int(found[0][0]) == processes and math.isfinite(float(found[0][1]))


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_word_language_model_example_trains_as_a_pipeline_and_loads_into_the_plain_module():
    result = run_command([sys.executable, str(EXAMPLES / "word_language_model.py")], timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    assert len(re.findall(r"^final loss: \S+$", result.stdout, flags=re.MULTILINE)) == 1, result.stdout[-4000:]
    assert "checkpoint loads into the plain RNNModel: 11 tensors" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_awd_lstm_example_trains_through_the_strategy():
    loss = load_example("awd_lstm").main()
    assert math.isfinite(loss) and 0 < loss < 10


@pytest.mark.timeout(60)
def test_compose_config_example_resolves_dp2_pp2(capsys):
    example = load_example("compose_config")
    layout = example.main()
    assert (layout.data_parallel_size, layout.pipeline_parallel_size, layout.stages_per_rank) == (2, 2, 1)
    assert layout.world_size == 4 and layout.schedule == "GPipe" and layout.n_microbatches == 2
    out = capsys.readouterr().out
    assert "processes for this model: 4" in out and "schedule=GPipe" in out
    assert "data_parallel_size=2 pipeline_parallel_size=2 stages_per_rank=1 processes=4" in out
    # The strategy resolves what the config leaves open: the partition's stage count, the schedule's stages.
    assert example.main(["experiment=mxnet2"]).pipeline_parallel_size == 2
    layout = example.main(["layout=pp2", "schedule.name=Interleaved1F1B"])
    assert (layout.stages_per_rank, layout.num_stages) == (2, 4)


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_sphinx_site_builds_without_warnings(tmp_path):
    # No importorskip: the README's install names the docs extra, so a missing package is a failure, not a skip.
    out = tmp_path / "html"
    sphinx = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)]
    result = run_command(sphinx, timeout=170)
    assert result.returncode == 0, result.stdout[-4000:]
    for page in PAGES:
        assert (out / f"{page}.html").is_file(), page
    # The examples are included verbatim, so the pages show the tested code.
    quickstart = (out / "quickstart.html").read_text()
    assert "tiny_data" in quickstart and "MPLSTMStrategy" in quickstart
    assert "initialize_config_dir" in (out / "configuration.html").read_text()
    assert "MPLSTMStrategy" in (out / "api.html").read_text()
    assert "layers.png" in (out / "architecture.html").read_text()  # the picture of the package's layers
    # The theme lays pages out wide and responsive, code blocks get a copy button, and the new pages are linked.
    index = (out / "index.html").read_text()
    assert "pydata-sphinx-theme" in index and "copybutton" in quickstart
    assert 'href="when_to_use.html"' in index and 'href="changelog.html"' in index
    # The strategy's options table is generated from the class: every argument a user sets is a row.
    strategy = (out / "strategy.html").read_text()
    assert all(f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{name}</span></code>" in strategy
               for name in ("tensor_parallel_size", "time_chunks", "checkpoint_format", "numerics"))


def test_the_reliability_page_shows_what_the_user_sees_in_every_tested_case():
    """Every case of ``RELIABILITY_MESSAGES`` (each matched against a real run by its test) has a row in
    docs/reliability.md's table "Stopped, preempted, stuck or diverging" whose last cell holds a match."""
    page = (DOCS / "reliability.md").read_text()
    table = page.split("## Stopped, preempted, stuck or diverging", 1)[1].split("\n## ", 1)[0]
    rows = {cells[1].strip(): cells[-2].strip() for cells in
            (line.split("|") for line in table.splitlines() if line.startswith("| ") and "---" not in line)}
    rows.pop("case")
    assert set(rows) == set(RELIABILITY_MESSAGES)
    for case, pattern in RELIABILITY_MESSAGES.items():
        assert re.search(pattern, rows[case]), (case, rows[case])
