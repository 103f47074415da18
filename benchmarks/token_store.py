"""The token store on a WikiText-103-shaped corpus: ``LMDataModule(source="wikitext").setup("fit")`` cold (the corpus
tokenized into an empty cache) and warm (the cache present), each in a fresh process, and what a process holds.

For each run: the seconds of ``setup("fit")``, then ``VmHWM`` (peak resident memory) and ``RssAnon`` (anonymous
memory: what the process holds of its own, not the memory-mapped token files) from ``/proc/self/status`` after
``setup`` and after iterating ``--batches`` training batches; ``after imports`` is what torch and Lightning hold
before any data is read. Also ``--processes`` processes opening the warm cache at once (the ranks of a
``torchrun``), and what the content keys and the checks cost: the hashes ``hashlib`` offers on the training file,
and the CRC-32 every open computes over the stored ids.

The corpus is made by ``benchmarks/wikitext_shaped.py`` (``--corpus`` names its directory; it is generated there
when it holds no corpus, 100 M training tokens by default: about 0.5 GB, so not inside the repository). The cache
goes into a temporary directory, removed at the end, unless ``--cache-dir`` names one (which must be empty).

Goals (issue 43): ``RssAnon`` <= 0.5 GB per process after setup and after the batches; warm ``setup("fit")`` <= 15 s.

    python benchmarks/token_store.py --corpus corpora/wt103 [--train-tokens 100000000] [--batches 300]
                                     [--processes 2] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The goals: anonymous memory per process, and the warm setup's seconds.
GOAL_ANON_BYTES, GOAL_WARM_SECONDS = 0.5e9, 15.0
_FIELDS = ("VmHWM", "RssAnon")


def _status() -> dict[str, int]:
    """``VmHWM`` and ``RssAnon`` of this process, bytes."""
    out = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


def child(corpus: str, cache_dir: str, batches: int, start_at: float) -> dict:
    """One process: import, ``setup("fit")``, ``batches`` training batches; times and memory after each."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(ROOT))
    from lightning_mp_lstm.data import LMDataModule

    result = {"after imports": _status()}
    data = LMDataModule(source="wikitext", path=corpus, cache_dir=cache_dir, batch_size=20, seed=0)
    while time.time() < start_at:  # processes started together begin together
        time.sleep(0.001)
    start = time.perf_counter()
    data.setup("fit")
    result["setup s"] = time.perf_counter() - start
    result["after setup"] = _status()
    start = time.perf_counter()
    for index, _ in enumerate(data.train_dataloader()):
        if index + 1 == batches:
            break
    result["batches s"] = time.perf_counter() - start
    result["after batches"] = _status()
    result["sentences"], result["vocab"] = data.stats()["sentences"]["train"], data.vocab_size
    return result


def _run(corpus: Path, cache_dir: Path, batches: int, processes: int = 1) -> list[dict]:
    """``processes`` fresh processes running :func:`child` at once."""
    start_at = time.time() + 6.0 * processes  # after every process has imported torch
    commands = [[sys.executable, __file__, "--child", str(corpus), str(cache_dir), str(batches), str(start_at)]
                for _ in range(processes)]
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True) for c in commands]
    results = []
    for process in running:
        out, _ = process.communicate()
        if process.returncode:
            raise RuntimeError(f"the measuring process failed ({process.returncode}):\n{out[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def hash_costs(path: Path) -> dict[str, float]:
    """Seconds to digest ``path`` with each hash of ``hashlib`` worth considering, and CRC-32 (best of 2)."""
    buffer = bytearray(1 << 24)
    view = memoryview(buffer)

    def seconds(update, state) -> float:
        best = float("inf")
        for _ in range(2):
            start, current = time.perf_counter(), state()
            with open(path, "rb", buffering=0) as handle:
                while size := handle.readinto(buffer):
                    current = update(current, view[:size])
            best = min(best, time.perf_counter() - start)
        return best

    costs = {"read only": seconds(lambda s, b: s, lambda: 0)}
    for name in ("sha256", "sha1", "md5", "blake2b", "blake2s", "sha512", "sha3_256"):
        costs[name] = seconds(lambda s, b: (s.update(b), s)[1], lambda n=name: hashlib.new(n))
    costs["crc32 (zlib)"] = seconds(lambda s, b: zlib.crc32(b, s), lambda: 0)
    costs["adler32 (zlib)"] = seconds(lambda s, b: zlib.adler32(b, s), lambda: 0)
    return costs


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path(tempfile.gettempdir()) / "wikitext-shaped",
                        help="directory of wiki.{train,valid,test}.tokens (generated there when missing)")
    parser.add_argument("--train-tokens", type=int, default=100_000_000, help="when generating the corpus")
    parser.add_argument("--batches", type=int, default=300, help="training batches iterated after setup")
    parser.add_argument("--processes", type=int, default=2, help="processes opening the warm cache at once")
    parser.add_argument("--cache-dir", type=Path, default=None, help="an empty directory (default: a temporary one)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        corpus, cache_dir, batches, start_at = args.child
        print(json.dumps(child(corpus, cache_dir, int(batches), float(start_at))))
        return
    train = args.corpus / "wiki.train.tokens"
    if not train.is_file():
        sys.path.insert(0, str(ROOT))
        from benchmarks.wikitext_shaped import generate

        print(f"generating a WikiText-103-shaped corpus of {args.train_tokens:,} training tokens in {args.corpus}")
        generate(args.corpus, args.train_tokens)
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="token-store-benchmark-"))
    if args.cache_dir is not None and any(cache_dir.glob("*")):
        raise SystemExit(f"--cache-dir {cache_dir} is not empty: the cold run needs an empty cache")
    try:
        rows = {"cold (empty cache)": _run(args.corpus, cache_dir, args.batches)[0],
                "warm (cache present)": _run(args.corpus, cache_dir, args.batches)[0]}
        together = _run(args.corpus, cache_dir, args.batches, args.processes)
        for rank, result in enumerate(together):
            rows[f"warm, {args.processes} processes at once: {rank}"] = result
        stored = max((cache_dir / "tokens").glob("split-*/tokens.bin"), key=lambda p: p.stat().st_size)
        hashes = hash_costs(train)
        sys.path.insert(0, str(ROOT))
        from lightning_mp_lstm.data.token_store import file_checksum

        start = time.perf_counter()
        file_checksum(stored)
        check, stored_bytes = time.perf_counter() - start, stored.stat().st_size
    finally:
        if args.cache_dir is None:
            shutil.rmtree(cache_dir, ignore_errors=True)

    first = rows["cold (empty cache)"]
    print(f"\ncorpus {args.corpus}: wiki.train.tokens {train.stat().st_size / 1e6:,.0f} MB, "
          f"{first['sentences']:,} training sentences, vocabulary {first['vocab']:,}; {os.cpu_count()} CPUs")
    print(f"\n| run | setup(\"fit\") s | VmHWM after setup GB | RssAnon after setup GB | {args.batches} batches s | "
          "VmHWM after batches GB | RssAnon after batches GB | RssAnon after imports GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['setup s']:.1f} | {_gb(r['after setup']['VmHWM'])} | {_gb(r['after setup']['RssAnon'])} |"
              f" {r['batches s']:.2f} | {_gb(r['after batches']['VmHWM'])} | {_gb(r['after batches']['RssAnon'])} |"
              f" {_gb(r['after imports']['RssAnon'])} |")
    size = train.stat().st_size
    print(f"\nhashing wiki.train.tokens ({size / 1e6:,.0f} MB), best of 2, file in the page cache:")
    print("| hash | s | GB/s |\n| --- | --- | --- |")
    for name, seconds in hashes.items():
        print(f"| {name} | {seconds:.2f} | {size / seconds / 1e9:.2f} |")
    print(f"\nchecking the stored ids when the cache is opened (CRC-32 of {stored.name}, "
          f"{stored_bytes / 1e6:,.0f} MB): {check:.2f} s")
    anon = max(max(r["after setup"]["RssAnon"], r["after batches"]["RssAnon"]) for r in rows.values())
    warm = max(r["setup s"] for name, r in rows.items() if name.startswith("warm"))
    print(f"\ngoal: RssAnon <= {GOAL_ANON_BYTES / 1e9:.1f} GB per process: largest {_gb(anon)} GB "
          f"({'met' if anon <= GOAL_ANON_BYTES else 'NOT met'})")
    print(f"goal: warm setup(\"fit\") <= {GOAL_WARM_SECONDS:.0f} s: slowest {warm:.1f} s "
          f"({'met' if warm <= GOAL_WARM_SECONDS else 'NOT met'})")


if __name__ == "__main__":
    main()
