"""One line far longer than the rest (issue #32): under ``buckets=auto`` it is split into pieces of the longest
usual bucket and the run trains in bounded memory; without a length cap the run is refused before launch
(``tests/test_bad_inputs.py``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_mp_lstm.data.buckets import OUTLIER_FACTOR, length_cap, resolve_buckets
from tests.helpers import RELIABILITY_MESSAGES, TINY_RUN, run_command

LONG = 100_000


def test_auto_buckets_cap_an_outlier_and_keep_a_corpus_s_own_tail():
    usual = np.random.default_rng(0).integers(5, 31, size=3000)
    with_outlier = np.append(usual, LONG + 1)
    cap = length_cap(with_outlier, "auto")
    assert cap == OUTLIER_FACTOR * int(np.percentile(usual, 99, method="lower"))
    assert resolve_buckets("auto", with_outlier, 5, "auto")[-1] == cap  # pieces of the cap, not 100,001 tokens
    assert resolve_buckets(None, with_outlier, max_length="auto") == [cap]
    assert resolve_buckets("auto", with_outlier, 5, None)[-1] == LONG + 1  # no cap: the old behaviour
    assert resolve_buckets("auto", with_outlier, 5, 64)[-1] == 64
    assert resolve_buckets("auto", usual, 5, "auto") == resolve_buckets("auto", usual, 5, None)  # nothing to cut
    with pytest.raises(ValueError, match=r"max_bucket_length must be a positive integer or 'auto', got 0"):
        length_cap(usual, 0)


_PEAK = """import resource, subprocess, sys
status = subprocess.run(sys.argv[1:]).returncode
print(f"peak RSS of any process: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024} bytes")
sys.exit(status)
"""


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_a_100000_token_line_trains_under_auto_buckets_in_bounded_memory(tmp_path: Path):
    """The issue's case, on two processes: the line becomes ~800 pieces of the longest usual bucket, which most
    training batches then hold; every process stays under 2 GB and the run ends within 60 s."""
    # 500 words: unsplit, a batch of 16 copies of the line would keep ~6 GB of activations (mostly the logits).
    words = [f"w{i}" for i in range(500)]
    lines = [" ".join(words[(i * 7 + j) % 500] for j in range(5 + i % 26)) for i in range(300)]
    lines.insert(7, " ".join(words[j % 500] for j in range(LONG)))
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(lines[20:60]) + "\n")
    args = [sys.executable, "-c", _PEAK, sys.executable, "train.py", "layout=pp2", *TINY_RUN, "data=text",
            f"data.train={tmp_path}/train.txt", f"data.valid={tmp_path}/valid.txt", f"data.test={tmp_path}/valid.txt",
            "~callbacks.timeline", "partition=even", "evaluate=false", f"hydra.run.dir={tmp_path}/run"]
    result = run_command(args, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(RELIABILITY_MESSAGES["a 100,000-token line, buckets=auto"], result.stdout), result.stdout[-3000:]
    assert "train tokens / s" in result.stdout  # the closing table
    peak = int(re.search(r"peak RSS of any process: (\d+) bytes", result.stdout).group(1))
    print(f"peak RSS of any process: {peak / 2**20:.0f} MiB")
    assert peak < 2 * 10**9, peak
