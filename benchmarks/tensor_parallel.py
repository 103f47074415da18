"""Tensor parallel (vocabulary-parallel decoder and embedding) against data parallel: bytes exchanged and step time.

Part ``comm`` (2 CPU ranks, gloo): the decoder and its loss for one batch, split by columns (tp2: ``ColwiseParallel``
+ ``loss_parallel``) or replicated (dp2: half the batch each, gradients all-reduced). Every collective's payload is
counted (:class:`CountCollectives` wraps torch's collective functions while the step runs) and printed next to the
weight-splitting essay's formula (model_parallelism_blog.txt: "split by the second dimension: stack the outputs
forward, add the input errors backward"; data parallel: the weight's gradient once).

Part ``layouts``: ``Trainer.fit`` with ``mp_lstm`` on a large-vocabulary model (default 30,000 words) as tp2, pp2
and dp2, 2 ranks each: median step time after warm-up and, per rank, the bytes of parameters, gradients and
Adam's state that rank holds (exact, from its local tensors, shards included).

Part ``lstm``: the analytic per-layer, per-microbatch communication of a column-split LSTM (input projection vs
recurrent part) for a model config (default ``conf/model/mxnet_ptb.yaml``); no processes.

    python benchmarks/tensor_parallel.py [--part comm|layouts|lstm|all] [--vocab 30000] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402


class CountCollectives:
    """Counts the bytes this process puts into collectives, by name, while active.

    It wraps ``torch.distributed.all_reduce`` (what data parallelism calls) and the functional collectives DTensor
    and ``loss_parallel`` call (``torch.distributed._functional_collectives``), so it also sees the collectives
    issued inside DTensor's operator handlers (a ``TorchDispatchMode`` is switched off there and misses them).
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name)

        def counted(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            self.bytes[name] = self.bytes.get(name, 0) + local.numel() * local.element_size()
            return original(tensor, *args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> CountCollectives:
        self._wrap(dist, "all_reduce")
        for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor"):
            self._wrap(funcol, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _comm_worker(rank: int, world_size: int, mode: str, rows: int, hidden: int, vocab: int) -> dict:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(rows, hidden)
    target = torch.randint(1, vocab, (rows,))
    decoder = torch.nn.Linear(hidden, vocab)
    counter = CountCollectives()
    if mode == "tp2":
        mesh = init_device_mesh("cpu", (world_size,))
        parallelize_module(decoder, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        with counter, loss_parallel():
            logits = decoder(x.requires_grad_())
            y = DTensor.from_local(target, mesh, [Replicate()], run_check=False)
            loss = F.cross_entropy(logits, y, ignore_index=0, reduction="sum")
            loss.to_local().backward()
    else:
        share = rows // world_size
        with counter:
            loss = F.cross_entropy(decoder(x[rank * share:(rank + 1) * share]), target[rank * share:(rank + 1) * share],
                                   ignore_index=0, reduction="sum")
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in decoder.parameters()])
            dist.all_reduce(flat)
    dist.destroy_process_group()
    return counter.bytes


def comm(rows: int, hidden: int, vocab: int) -> None:
    print(f"decoder {hidden} x {vocab}, batch of {rows} tokens (float32), 2 ranks; bytes one rank sends into "
          "collectives per step (all-reduce of n bytes: the payload n, whatever the algorithm)")
    # The essay's arithmetic for a weight split by its second dimension over k devices: forward, stack the
    # N x out outputs; backward, add the N x in input errors. Data parallel: the in x out gradient once.
    seed_tp = (rows * vocab + rows * hidden) * 4
    seed_dp = (hidden * vocab + vocab) * 4
    ours_tp = (rows * hidden + 3 * rows) * 4  # input-gradient all-reduce + loss_parallel's max, sum, target logit
    for mode, formula, predicted in (("tp2", seed_tp, ours_tp), ("dp2", seed_dp, seed_dp)):
        counted = run_ranks(_comm_worker, 2, mode, rows, hidden, vocab, timeout=300)[0]
        total = sum(counted.values())
        print(f"  {mode}: counted {total:>12,} B {dict(sorted(counted.items()))}; essay's formula {formula:>12,} B; "
              f"predicted {predicted:,} B")
    print("  tp2 with loss_parallel never sends the N x V logits the essay's 'stack' step would: only the N x H "
          "input errors (added) and three N-vectors of the softmax")


class _Batches(pl.LightningDataModule):
    def __init__(self, vocab: int, rows: int, length: int, steps: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.batch_size = rows
        self.mean_padded_length = float(length)
        self.batches = [(torch.randint(1, vocab, (rows, length), generator=g),
                         torch.randint(1, vocab, (rows, length), generator=g)) for _ in range(steps)]

    def train_dataloader(self) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
        share = self.batch_size // replicas
        return DataLoader([(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
                           for x, y in self.batches], batch_size=None)


class _StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: object) -> None:
        self.starts.append(time.perf_counter())


def _layout_worker(rank: int, world_size: int, kwargs: dict, vocab: int, steps: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = LSTMLanguageModel(vocab, embedding_dim=200, hidden_size=200, num_layers=2, optimizer="adam", lr=1e-3)
    times = _StepTimes()
    strategy = MPLSTMStrategy(report_after_steps=None, **kwargs)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[times])
    trainer.fit(model, datamodule=_Batches(vocab, 20, 35, steps))

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    state = sum(local_bytes(v) for s in trainer.optimizers[0].state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    intervals = [b - a for a, b in zip(times.starts, times.starts[1:])][2:]  # skip warm-up steps
    return {"step_s": statistics.median(intervals), "param_bytes": params, "grad_bytes": params,
            "adam_bytes": state}


def layouts(vocab: int, steps: int) -> None:
    print(f"LSTM LM 2 x 200, vocabulary {vocab:,}, batch 20 x 35, Adam, 2 ranks x 1 thread, {steps} steps")
    print(f"{'layout':8} {'step s (median)':>16} {'params+grads+adam MiB per rank':>32}")
    for name, kwargs in (("tp2", dict(tensor_parallel_size=2, pipeline_parallel_size=1)),
                         ("pp2", dict(pipeline_parallel_size=2, n_microbatches=2)),
                         ("dp2", dict(data_parallel_size=2, pipeline_parallel_size=1))):
        results = run_ranks(_layout_worker, 2, kwargs, vocab, steps, timeout=600)
        step = max(r["step_s"] for r in results)
        memory = ", ".join(f"{(r['param_bytes'] + r['grad_bytes'] + r['adam_bytes']) / 2**20:.1f}" for r in results)
        print(f"{name:8} {step:>16.3f} {memory:>32}")


def lstm(config: str) -> None:
    import yaml

    with open(config) as handle:
        cfg = yaml.safe_load(handle)
    e, h, layers = int(cfg["embedding_dim"]), int(cfg["hidden_size"]), int(cfg["num_layers"])
    rows, length = 20, 35  # MXNet's example's PTB batch, a typical bucket
    print(f"{os.path.basename(config)}: embedding {e}, hidden {h}, {layers} layers; microbatch {rows} x {length}; "
          "float32 elements one rank exchanges per layer per microbatch, tp=2 (analytic)")
    # Input projection x . W_ih (all time steps at once) split by columns: each rank computes 4h/2 gate columns
    # for all T steps; forward, one all-gather of the gates (T x B x 4h/2 from each); backward, one all-reduce of
    # the input error (T x B x in).
    for layer in range(min(layers, 2)):
        width = e if layer == 0 else h
        projection = length * rows * (4 * h // 2 + width)
        # Recurrent part h_{t-1} . W_hh split by columns: every step needs the whole h_{t-1}: one all-gather of
        # B x h/2 per step forward and one all-reduce of B x h backward, T times, latency-bound (2T exchanges).
        recurrent = length * (rows * h // 2 + rows * h)
        print(f"  layer {layer}: input projection {projection:,} elements in 2 exchanges; recurrent part "
              f"{recurrent:,} elements in {2 * length} exchanges (one per step each way)")
    print(f"  data parallel instead: the layer's gradient, {4 * h * (e + h) + 8 * h:,} elements once per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["comm", "layouts", "lstm", "all"])
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=20 * 35, help="tokens per decoder batch (part comm)")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "conf", "model",
                                                         "mxnet_ptb.yaml"))
    args = parser.parse_args()
    if args.part in ("comm", "all"):
        comm(args.rows, 400, args.vocab)
    if args.part in ("lstm", "all"):
        lstm(args.config)
    if args.part in ("layouts", "all"):
        layouts(args.vocab, args.steps)


if __name__ == "__main__":
    main()
