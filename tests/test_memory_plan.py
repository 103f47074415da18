"""The memory plan: every process's peak predicted from shapes (nothing allocated), a layout that cannot fit refused
before launch with its table and the layouts that would, the one-file checkpoint only where rank 0 can gather it, and
no rank ever allocating another rank's blocks (counted).

How close the prediction comes to measured peaks is a benchmark (``benchmarks/wt103.py``), not a test.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMBlocks, LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.memory import BatchShape, MemoryPlanError, ModelMemory, plan_memory, process_floor
from lightning_mp_lstm.strategy.memory_check import largest_batch, optimizer_state_factor
from lightning_mp_lstm.strategy.options import ProcessOptions
from lightning_mp_lstm.strategy.pipeline_setup import plan_memory_of_run
from tests.helpers import (
    ROOT,
    VOCAB,
    FixedBatches,
    cpu_engine,
    lm_batches,
    quiet_trainer,
    rel_error,
    run_ranks,
    tiny_model,
)

MIB = 2**20


@pytest.mark.parametrize(("options", "factor"), [(dict(optimizer="adam"), 2.0), (dict(optimizer="sgd"), 0.0),
                                                 (dict(optimizer="sgd", momentum=0.9), 1.0)])
def test_the_optimizer_state_is_read_from_the_module_s_own_optimizer(options, factor):
    assert optimizer_state_factor(tiny_model(**options))[0] == factor
    with torch.device("meta"):  # built on the meta device, as train.py builds it
        assert optimizer_state_factor(tiny_model(**options))[0] == factor


def test_the_plan_adds_up_what_each_process_holds():
    model = ModelMemory(parameters={"embedding": 100 * MIB, "lstm.0": 10 * MIB, "lstm.1": 10 * MIB,
                                    "decoder": 50 * MIB},
                        activations={"embedding": 1000.0, "lstm.0": 8000.0, "lstm.1": 8000.0, "decoder": 500.0},
                        vocabulary=10_000, slice_tokens=64, optimizer_factor=2.0)
    layout = ParallelLayout(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=4)
    batch = BatchShape(rows=16, length=50)
    plan = plan_memory(model, layout, [["embedding", "lstm.0"], ["lstm.1", "decoder"]], batch, floor=300 * MIB,
                       budget=1000 * MIB, source="a test", one_file_checkpoint=True)
    first, last = plan.ranks
    assert (first.parameters, first.gradients, first.optimizer) == (110 * MIB, 110 * MIB, 220 * MIB)
    # 1F1B: stage 0 keeps 2 microbatches of 4 rows x 50 tokens in flight, the last stage 1.
    assert first.activations == 2 * 4 * 50 * (1000 + 8000) and last.activations == 4 * 50 * (8000 + 500)
    assert first.loss == 0 and last.loss == 3 * 64 * 10_000 * 4  # three copies of a 64-token slice of logits
    assert first.saving == 60 * MIB * 3 and last.saving == 0  # rank 0 receives the other ranks' parameters and Adam
    assert first.temporary == 100 * MIB and last.temporary == 50 * MIB  # the largest block's fresh gradient
    assert first.total == 300 * MIB + 440 * MIB + first.activations + 100 * MIB + 180 * MIB and not plan.fits
    assert plan.peak == first.total
    table = plan.table()
    assert "budget 1,000 MiB per process (a test)" in table and "embedding, lstm.0" in table
    tied = plan_memory(ModelMemory(**{**model.__dict__, "tied_copy": 100 * MIB}), layout,
                       [["embedding", "lstm.0"], ["lstm.1", "decoder"]], batch, 0)
    assert tied.ranks[1].parameters == 160 * MIB  # the decoder's copy of the embedding's matrix


def test_an_evaluation_batch_is_planned_beside_the_state_training_leaves():
    """Evaluation runs mid-training, with the gradients and optimizer state held; its batches are often larger."""
    outputs = {"embedding": 64.0, "lstm.0": 128.0, "lstm.1": 128.0}
    whole = ModelMemory(parameters={"embedding": 10 * MIB, "lstm.0": MIB, "lstm.1": MIB, "decoder": 10 * MIB},
                        activations={"embedding": 100.0, "lstm.0": 2000.0, "lstm.1": 2000.0, "decoder": 4e4},
                        vocabulary=10_000, slice_tokens=None, optimizer_factor=2.0,
                        outputs={**outputs, "decoder": 40_000.0})  # its loss takes a microbatch's whole logits
    layout = ParallelLayout(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2)
    partition = [["embedding", "lstm.0"], ["lstm.1", "decoder"]]
    small = plan_memory(whole, layout, partition, BatchShape(8, 20, evaluation=BatchShape(8, 20)), 0)
    large = plan_memory(whole, layout, partition, BatchShape(8, 20, evaluation=BatchShape(400, 20)), 0)
    first, last = large.ranks
    tokens = 200 * 20  # a microbatch of the evaluation batch
    # Every microbatch's outputs kept until the step ends, the buffers stage 1 receives them in, one microbatch's
    # LSTM forward (three of its outputs), and the log-probabilities of a microbatch's logits.
    assert first.evaluation == 2 * tokens * 128 + tokens * 3 * 128
    assert last.evaluation == 2 * tokens * 40_000 + 2 * tokens * 128 + tokens * 3 * 128 + tokens * 10_000 * 4
    assert last.total == last.evaluating == last.parameters + last.gradients + last.optimizer + last.evaluation
    assert small.ranks[1].total == small.ranks[1].training > small.ranks[1].evaluating  # training's set is larger
    assert large.peak > 6 * small.peak and "eval" in large.table().splitlines()[1]
    decoding = ModelMemory(**{**whole.__dict__, "slice_tokens": 64, "outputs": {**outputs, "decoder": 512.0}})
    sliced = plan_memory(decoding, layout, partition, BatchShape(8, 20, evaluation=BatchShape(400, 20)), 0)
    assert sliced.ranks[1].evaluation == 2 * tokens * 512 + 2 * tokens * 128 + tokens * 3 * 128 + 2 * 64 * 10_000 * 4
    assert plan_memory(whole, layout, partition, BatchShape(8, 20), 0).ranks[1].evaluation == 0  # none: not planned


class _Split:
    """A bucketed split: how many sentences each bucket length holds."""

    def __init__(self, held: dict[int, int]) -> None:
        self.buckets = sorted(held)
        self.bucket_indices = [self.buckets.index(length) for length, n in held.items() for _ in range(n)]


class _Bucketed:
    bucket_lengths, batch_size, eval_batch_size, max_tokens, mode = [10, 20, 40], 8, 100, None, "sentences"
    splits = {"train": {10: 50, 20: 50, 40: 3}, "valid": {10: 300, 20: 60, 40: 2}, "test": {10: 5, 20: 80}}

    def dataset(self, split: str) -> _Split:
        return _Split(self.splits[split])


def test_the_plan_takes_the_longest_training_batch_and_the_evaluation_batch_of_the_most_tokens():
    batch = largest_batch(_Bucketed(), ParallelLayout(data_parallel_size=2, pipeline_parallel_size=1))
    # Training: the longest bucket's 3 sentences, 2 on a replica. Evaluation: 100 x 10 = 1,000 tokens, 80 x 20 (the
    # test split's 80 sentences of 20) = 1,600, 2 x 40 = 80: 80 x 20, 40 on a replica.
    assert batch == BatchShape(2, 40, evaluation=BatchShape(40, 20))


def test_an_evaluation_batch_that_cannot_fit_is_refused_with_what_to_change():
    gib = round(process_floor() / 2**30 + 0.5, 2)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, memory_per_process=gib, report_after_steps=None)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    model, data = tiny_model(), FixedBatches()
    strategy.check(model, data)  # training and evaluation batches of 8 sentences fit
    data.eval_batch_size = 2_000_000  # as LMDataModule exposes it: 18 M tokens of a 9-token bucket
    with pytest.raises(MemoryPlanError) as refused:
        strategy.check(model, data)
    message = str(refused.value)
    assert "(mostly an evaluation batch)" in message and f"more than the {gib:.2f} GiB a process may use" in message
    assert "the largest evaluation batch (2,000,000 sentences of 9 tokens per replica)" in message
    assert "a smaller data.eval_batch_size" in message


def test_no_step_keeps_its_outputs_once_it_is_done():
    """torch's stages clear what they keep of a step (every microbatch's outputs, in evaluation) only when their next
    step starts, and the engine keeps a schedule per batch shape: each shape would hold its last batch's outputs."""
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, report_after_steps=None, verify=False)
    trainer = quiet_trainer(strategy, 1, max_steps=2)
    try:
        trainer.fit(tiny_model(), FixedBatches())
        trainer.validate(trainer.lightning_module, FixedBatches())  # batches of 6 and 9 tokens: two shapes
    finally:
        strategy.shutdown()
    schedules = list(strategy._run.engine._schedules.values())
    stages = [stage for schedule in schedules for stage in getattr(schedule, "_stages", None) or [schedule._stage]]
    assert len(schedules) >= 4 and len(stages) == len(schedules)  # training's and evaluation's shapes
    assert all(not stage.fwd_cache and not stage.output_chunks for stage in stages)


def _buffers_worker(rank: int, world_size: int, config: dict) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        layout = ParallelLayout(**config)
        module = tiny_model(num_layers=3, loss_chunk_tokens=4)
        reference = copy.deepcopy(module)
        engine = cpu_engine(module, layout, rank)
        worst = 0.0
        for inputs, targets in lm_batches(8, (5, 9, 5, 9)):  # each shape runs again after the other ran
            module.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            result = engine.forward_backward((inputs, targets))
            engine.reduce_gradients(module.parameters())
            expected = token_loss_sum(reference(inputs)[0], targets) / (targets != 0).sum()
            expected.backward()
            grads = {name: p.grad for name, p in reference.named_parameters()}
            worst = max(worst, rel_error(result.loss, expected.detach()),
                        *(rel_error(p.grad, grads[name]) for name, p in module.named_parameters()))
        inputs, targets = lm_batches(8, (6,))[0]
        with torch.no_grad():
            evaluated = engine.evaluate((inputs, targets)).loss
            expected = token_loss_sum(reference(inputs)[0], targets) / (targets != 0).sum()
        worst = max(worst, rel_error(evaluated, expected))
        buffers = {}  # each schedule's receive buffers' devices (none for the wavefront loop evaluation runs in)
        for key, schedule in engine._schedules.items():
            stages = [stage for stage in getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
                      if stage is not None]
            buffers[key] = [info.buffer.device.type for stage in stages
                            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
                            for info in infos if not info.is_root_arg and info.buffer is not None]
    finally:
        dist.destroy_process_group()
    return {"worst": worst, "buffers": buffers}


@pytest.mark.timeout(120)
@pytest.mark.processes
@pytest.mark.parametrize("config", [dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2),
                                    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="ZBVZeroBubble",
                                         n_microbatches=4)], ids=["1F1B", "ZBVZeroBubble"])
def test_only_the_schedule_in_use_holds_its_receive_buffers(config):
    """torch's stages keep a buffer per microbatch for what they receive, for their life; a schedule per batch shape
    would hold them for every shape run. A schedule that runs again after another receives into new buffers, and its
    results stay those of one process."""
    results = run_ranks(_buffers_worker, 2, config, timeout=100)
    for rank, result in enumerate(results):
        assert result["worst"] < 1e-5, (rank, result)
        buffers = result["buffers"]
        assert set(buffers) == {(8, 5, "train"), (8, 9, "train"), (8, 6, "eval")}
        assert all(buffers[key] and set(buffers[key]) == {"meta"} for key in [(8, 5, "train"), (8, 9, "train")])
        assert set(buffers[8, 6, "eval"]) <= {"cpu"}  # the schedule that ran last
    if config["schedule"] == "1F1B":
        assert len(results[1]["buffers"][8, 6, "eval"]) == 2  # rank 1 receives each microbatch's activations


def test_a_run_that_only_evaluates_is_planned_for_its_parameters_and_evaluation_batches():
    data = FixedBatches()
    data.eval_batch_size = 64
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, verify=False)
    try:
        quiet_trainer(strategy, 1).validate(tiny_model(), data)
    finally:
        strategy.shutdown()
    rank = strategy.memory.ranks[0]
    assert rank.parameters > 0 and rank.evaluation > 0 and rank.total == rank.evaluating
    assert rank.gradients == rank.optimizer == rank.activations == rank.loss == rank.temporary == rank.saving == 0
    gib = round(process_floor() / 2**30 + 0.5, 2)
    data.eval_batch_size = 2_000_000
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, memory_per_process=gib, report_after_steps=None,
                              verify=False)
    try:
        with pytest.raises(MemoryPlanError, match=r"\(mostly an evaluation batch\)"):
            quiet_trainer(strategy, 1).validate(tiny_model(), data)
    finally:
        strategy.shutdown()


def test_a_trainer_that_validates_before_it_fits_plans_its_training_when_it_fits():
    """A baseline validation first builds the pipeline; the first fit then plans what training holds."""
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, verify=False)
    trainer, model = quiet_trainer(strategy, 1, max_steps=1), tiny_model(optimizer="adam")
    try:
        trainer.validate(model, FixedBatches(), verbose=False)
        evaluating = strategy.memory.ranks[0]
        trainer.fit(model, FixedBatches())
    finally:
        strategy.shutdown()
    training = strategy.memory.ranks[0]
    assert evaluating.gradients == evaluating.optimizer == 0 and evaluating.evaluation > 0
    assert training.gradients == training.parameters > 0 and training.optimizer == 2 * training.parameters  # Adam
    assert training.total > evaluating.total


class _WholeLogits(pl.LightningModule):
    """A user's module whose loss takes a microbatch's whole logits (word_language_model style)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.rnn = torch.nn.Embedding(VOCAB, 6), torch.nn.LSTM(6, 8, 2, batch_first=True)
        self.decoder = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.encoder(tokens))[0])

    def lm_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=0)

    def training_step(self, batch, batch_idx):
        return self.lm_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", loss="lm_loss")


def test_a_prediction_after_a_fit_is_planned_beside_what_the_fit_still_holds():
    """A fit's plan counts its validation; a predict of the same Trainer merges every microbatch's logits while the
    gradients and optimizer state are still held: it is planned again, not left to the fit's plan."""
    strategy, alone = (MPLSTMStrategy(pipeline_parallel_size=1, n_microbatches=2, report_after_steps=None,
                                      verify=False) for _ in range(2))
    trainer, model = quiet_trainer(strategy, 1, max_steps=1), _WholeLogits()
    try:
        trainer.fit(model, FixedBatches())
        training = strategy.memory.ranks[0]
        trainer.predict(model, FixedBatches(), return_predictions=False)
        quiet_trainer(alone, 1).predict(_WholeLogits(), FixedBatches(), return_predictions=False)
    finally:
        strategy.shutdown()
        alone.shutdown()
    predicting, predicting_alone = strategy.memory.ranks[0], alone.memory.ranks[0]
    assert (predicting.gradients, predicting.optimizer) == (training.gradients, training.optimizer)
    assert predicting.optimizer == 2 * predicting.gradients > 0  # Adam's two moments
    assert predicting.evaluation == predicting_alone.evaluation > training.evaluation  # the merged logits
    assert predicting.total == predicting.evaluating  # nothing of a training step runs
    held, held_alone = predicting.total - predicting.floor, predicting_alone.total - predicting_alone.floor
    assert held == held_alone + 3 * predicting.gradients


class _Unshaped(FixedBatches):
    bucket_lengths = None  # the shape of its batches is not said


@pytest.mark.parametrize("data", [FixedBatches, _Unshaped])
def test_a_run_says_how_its_memory_is_planned(caplog, data):
    """From the data's shapes before the first batch; where the data does not say them, from the first batch of each
    kind (the sanity check's validation batch first: no gradient or optimizer state yet), before it runs."""
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, verify=False)
    with caplog.at_level("INFO"):
        try:
            quiet_trainer(strategy, 1, max_steps=1, num_sanity_val_steps=1).fit(tiny_model(), data())
        finally:
            strategy.shutdown()
    rank = strategy.memory.ranks[0]
    assert rank.activations > 0 and rank.gradients > 0 and rank.evaluation > 0
    if data is FixedBatches:
        assert "memory per process (MiB, predicted peak" in caplog.text and "first batches" not in caplog.text
        return
    assert "memory per process: planned from the first batches: a larger batch later is found only by running it " \
        "(_Unshaped does not say its batches' shape: batch_size and bucket_lengths" in caplog.text
    lines = [line for line in caplog.text.splitlines() if "memory planned from the first batches" in line]
    assert [line.split("rows per replica x tokens: ")[1] for line in lines] == [
        "evaluation 8 x 6):", "training 8 x 5; evaluation 8 x 6):"]


def test_unshaped_data_is_planned_at_the_first_batch_of_a_validation_and_from_the_batches_seen_after_a_fit():
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, verify=False)
    try:
        quiet_trainer(strategy, 1).validate(tiny_model(), _Unshaped(), verbose=False)
        validating = strategy.memory.ranks[0]
        fitting = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, verify=False)
        trainer, model = quiet_trainer(fitting, 1, max_steps=1), tiny_model()
        trainer.fit(model, _Unshaped())
        trainer.predict(model, _Unshaped(), return_predictions=False)  # planned before its first batch runs
    finally:
        strategy.shutdown()
        fitting.shutdown()
    assert validating.evaluation > 0 and validating.gradients == validating.optimizer == validating.activations == 0
    predicting = fitting.memory.ranks[0]
    assert fitting._run.memory_purpose == "predict_after_fit" and predicting.gradients > 0
    assert predicting.evaluation > 0 and predicting.activations == 0


def test_a_first_batch_that_cannot_fit_is_refused_before_it_runs():
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, memory_per_process=0.01, report_after_steps=None,
                              verify=False)
    trainer = quiet_trainer(strategy, 1, max_steps=1)
    try:
        with pytest.raises(MemoryPlanError, match=r"0\.01 GiB a process may use"):
            trainer.fit(tiny_model(), _Unshaped())
    finally:
        strategy.shutdown()
    assert trainer.global_step == 0


def test_sharded_replicas_hold_their_share_and_what_a_step_gathers_whole():
    model = ModelMemory(parameters={"embedding": 100 * MIB, "lstm.0": 10 * MIB, "lstm.1": 20 * MIB,
                                    "decoder": 50 * MIB},
                        activations={"embedding": 1.0, "lstm.0": 1.0, "lstm.1": 1.0, "decoder": 1.0},
                        vocabulary=100, slice_tokens=64, optimizer_factor=2.0)
    batch = BatchShape(rows=16, length=50)
    one_stage = ParallelLayout(data_parallel_size=4, pipeline_parallel_size=1, schedule="1F1B", n_microbatches=1)
    blocks = [["embedding", "lstm.0", "lstm.1", "decoder"]]
    replicated = plan_memory(model, one_stage, blocks, batch, 0).ranks[0]
    sharded = plan_memory(model, one_stage, blocks, batch, 0, shard=4).ranks[0]
    # A quarter of everything, plus the largest block being run and the decoder the loss runs, gathered whole.
    assert sharded.parameters == 180 * MIB // 4 + 100 * MIB + 50 * MIB
    assert (sharded.gradients, sharded.optimizer) == (180 * MIB // 4, 360 * MIB // 4)
    assert sharded.total < replicated.total
    # Several microbatches: torch's stage keeps every block and its gradient whole until the last backward.
    pipeline = ParallelLayout(data_parallel_size=2, pipeline_parallel_size=2, schedule="GPipe", n_microbatches=2)
    last = plan_memory(model, pipeline, [["embedding"], ["lstm.0", "lstm.1", "decoder"]], batch, 0, shard=2).ranks[1]
    assert (last.parameters, last.gradients, last.optimizer) == (120 * MIB, 120 * MIB, 80 * MIB)


_PROBE = """
import resource, torch
from lightning_mp_lstm import LSTMLanguageModel
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.strategy.memory_check import model_memory
with torch.device("meta"):
    model = LSTMLanguageModel(267_735, 1024, 2048, 4)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
memory = model_memory(pipeline_model(model), model)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(sum(memory.parameters.values()), after - before)
"""


@pytest.mark.processes
def test_planning_a_model_larger_than_the_machine_allocates_none_of_it():
    """A 950-million-parameter model (3.5 GiB of float32 weights, 14 GiB with Adam) is planned, its activations
    probed block by block, in a process whose peak memory grows by less than 100 MiB."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    parameters, grown_kib = map(int, done.stdout.split())
    assert parameters > 3.5 * 2**30
    assert grown_kib < 100 * 1024, grown_kib


def _big_model() -> LSTMLanguageModel:
    with torch.device("meta"):  # 2 x 25.6 M parameters in the vocabulary layers: 0.8 GiB with Adam
        return LSTMLanguageModel(100_000, 256, 256, 2, optimizer="adam")


def test_a_layout_that_cannot_fit_is_refused_before_launch_with_the_table_and_the_layouts_that_fit():
    # The model's state takes 0.8 GiB on one process, 0.4 GiB on each of two: a budget between them, over the floor
    # every process of this one's kind holds (its imports and data, measured in the planning process).
    gib = round(process_floor() / 2**30 + 0.6, 2)
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, memory_per_process=gib, report_after_steps=None)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    model = _big_model()
    with pytest.raises(MemoryPlanError) as refused:
        strategy.check(model, FixedBatches())
    message = str(refused.value)
    assert "1 process(es) of ParallelLayout(" in message and f"more than the {gib:.2f} GiB a process may use " \
        f"(strategy.memory_per_process={gib})" in message
    assert "mostly parameters, gradients and optimizer state" in message
    assert "rank  blocks" in message and "embedding, lstm.0-1, decoder" in message
    assert "Layouts that fit: " in message and "layout=pp2 (" in message  # each rank holds one vocabulary layer
    roomy = MPLSTMStrategy(pipeline_parallel_size=1, memory_per_process=64, report_after_steps=None)
    pl.Trainer(strategy=roomy, accelerator="cpu", devices=1, logger=False)
    roomy.check(model, FixedBatches())  # fits: no error


def test_the_one_file_checkpoint_is_chosen_only_where_rank_zero_can_gather_the_model():
    model = _big_model()
    blocks = pipeline_model(model)
    layout = ParallelLayout(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2)
    options = MPLSTMStrategy(pipeline_parallel_size=2)._run.options
    cpu = torch.device("cpu")

    def chosen(gib: float, fmt: str = "auto") -> tuple:
        process = ProcessOptions(pipeline_parallel_size=2, memory_per_process=gib, checkpoint_format=fmt)
        plan, kind = plan_memory_of_run(model, blocks, layout, options, process, FixedBatches(), cpu, 2)
        return plan.ranks[0].saving, kind

    saving, kind = chosen(64)
    others = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("lstm.1", "decoder")))
    assert kind == "file" and saving == others * 4 * 3  # rank 0 receives rank 1's parameters and Adam's 2 states
    training = plan_memory_of_run(model, blocks, layout, options, ProcessOptions(
        pipeline_parallel_size=2, memory_per_process=64, checkpoint_format="sharded"), FixedBatches(), cpu, 2)[0]
    between = (training.peak + saving / 2) / 2**30
    assert chosen(between) == (0, "sharded")
    with pytest.raises(MemoryPlanError, match=r"saving a one-file checkpoint gathers the whole model .* Save sharded"):
        chosen(between, "file")


class _Allocations(TorchDispatchMode):
    """Every 2-D shape a real (not meta, not fake) tensor took on this process."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and not tensor.is_meta \
                    and type(tensor) is torch.Tensor:
                self.shapes.add(tuple(tensor.shape))
        return out


#: Block shapes no other block has: vocabulary 1,009 words, embedding 11 wide, hidden 13.
_EMBEDDING, _DECODER, _FIRST_LAYER = (1009, 11), (1009, 13), (52, 11)


def _counted_worker(rank: int, world_size: int, checkpoint: str) -> list:
    warnings.filterwarnings("ignore")
    strategy = MPLSTMStrategy(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2, checkpoint_format="sharded",
                              report_after_steps=None, timeout=60)
    trainer = quiet_trainer(strategy, world_size, max_steps=2, enable_model_summary=True)
    with trainer.init_module(empty_init=True):
        model = LSTMLanguageModel(1009, 11, 13, 3, optimizer="adam", lr=0.01)
    model.example_input_array = torch.zeros((4, 5), dtype=torch.long)  # the whole model's summary counts FLOPs
    data = FixedBatches()
    recorder = _Allocations()
    with recorder:
        strategy.check(model, data)  # what train.py runs before launch, here on every rank
        trainer.fit(model, datamodule=data)
        trainer.save_checkpoint(checkpoint)
    return sorted(recorder.shapes)


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_no_rank_ever_allocates_another_rank_s_blocks(tmp_path):
    """Checks, the plan, the summary, training and a sharded checkpoint: rank 0 (embedding, lstm.0) never makes a
    tensor of the decoder's shape, rank 1 (lstm.1-2, decoder) none of the embedding's or the first layer's."""
    shapes = run_ranks(_counted_worker, 2, str(tmp_path / "sharded.ckpt"), timeout=110)
    first, second = ({tuple(s) for s in rank} for rank in shapes)
    assert _EMBEDDING in first and _FIRST_LAYER in first  # what the counting sees on a rank's own blocks
    assert _DECODER in second
    assert not {_DECODER, _DECODER[::-1]} & first, sorted(first)
    assert not {_EMBEDDING, _EMBEDDING[::-1], _FIRST_LAYER, _FIRST_LAYER[::-1]} & second, \
        {_EMBEDDING, _EMBEDDING[::-1], _FIRST_LAYER, _FIRST_LAYER[::-1]} & second


@pytest.mark.parametrize("room", ["roomy", "tight"])
def test_steps_keep_freed_memory_in_the_heap_only_where_the_plan_leaves_room(monkeypatch, room):
    """Mapping every tensor of 1 MiB or more afresh costs each step its page faults (a one-process step of MXNet's
    8 x 400 model took 1.4x as long): once the blocks are built the threshold goes up, unless the predicted peak is
    near the budget, where the plan's exactness matters more."""
    from lightning_mp_lstm.base import allocator
    from lightning_mp_lstm.strategy import strategy as strategy_module

    thresholds = []
    monkeypatch.setattr(strategy_module, "return_freed_memory", lambda *t: thresholds.append(t))
    gib = 64 if room == "roomy" else round(1.1 * process_floor() / 2**30, 3)  # the floor is most of the peak
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, memory_per_process=gib, report_after_steps=None,
                              verify=False)
    quiet_trainer(strategy, 1, max_steps=1, limit_val_batches=0).fit(tiny_model(), datamodule=FixedBatches())
    assert strategy.memory.peak > (allocator.ROOM * strategy.memory.budget if room == "tight" else 0)
    expected = allocator.STEADY_MMAP_THRESHOLD if room == "roomy" else allocator.MMAP_THRESHOLD
    assert thresholds == [(), (expected,)]  # while building: the default, 1 MiB
    assert allocator.steady_threshold(None, None) == allocator.STEADY_MMAP_THRESHOLD
    assert allocator.steady_threshold(None, None, sharded=True) == allocator.MMAP_THRESHOLD
    strategy.shutdown()
