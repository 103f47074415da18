"""The step hooks of Lightning's ``Strategy`` for a pipeline: ``MPLSTMStrategy`` takes them from
:class:`PipelineSteps`. Each runs the batch through the engine under the precision plugin's context and logs the loss
and the terms of the module's declared loss and penalty; the module's own ``*_step`` methods are not called (the
pieces its declaration names are, in the stages that hold their inputs)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_mp_lstm.models.metrics import LanguageModelMetrics
from lightning_mp_lstm.pipeline.engine import PipelineEngine
from lightning_mp_lstm.planning import report
from lightning_mp_lstm.strategy.batches import check_same_batch
from lightning_mp_lstm.strategy.precision import PipelinePrecision

if TYPE_CHECKING:
    from lightning_mp_lstm.strategy.verify import Verifier

__all__ = ["PipelineSteps"]


class PipelineSteps:
    """Lightning's training, validation, test and prediction steps and the hooks that start an epoch or an
    evaluation, mixed into a Lightning ``Strategy`` that gives the engine, the precision plugin, the metrics and the
    step clock (:class:`~lightning_mp_lstm.planning.report.StepClock`) of the report after the first steps."""

    engine: PipelineEngine
    precision_plugin: PipelinePrecision
    lightning_module: Any
    root_device: Any
    data_parallel_rank: int
    report: str
    _metrics: LanguageModelMetrics
    _step_clock: report.StepClock
    _measurements: report.Measurements | None
    _verifier: Verifier | None
    #: The numerical check of the module's declaration, once it ran (its table: ``verification.table()``).
    verification: Any = None

    @override
    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        """Run the batch forward and backward through the pipeline (the gradients wait in the precision plugin for
        Lightning's ``backward``); log and return its loss."""
        trainer = self.lightning_module.trainer
        with self.precision_plugin.train_step_context():
            result = self.engine.forward_backward(batch, accumulation=trainer.accumulate_grad_batches)
        self.engine.check_finite(result.loss, f"global step {trainer.global_step} (epoch {trainer.current_epoch}, "
                                              f"batch_idx {batch_idx})")
        self._metrics.log(self.lightning_module, "train", result.loss, result.tokens, _rows(batch), result.weights,
                          result.terms, rows_are_global=self.engine.global_batches
                          or self.engine.layout.data_parallel_size == 1)
        return result.loss

    @override
    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        return self._evaluate(batch, batch_idx, "val", self.precision_plugin.val_step_context())

    @override
    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        return self._evaluate(batch, batch_idx, "test", self.precision_plugin.test_step_context())

    def _evaluate(self, batch: Any, batch_idx: int, split: str, context: Any) -> Tensor:
        if batch_idx == 0:
            self._check_same_batch(batch, f"the first {split} batch")
        with context:
            result = self.engine.evaluate(batch)
        self._metrics.log(self.lightning_module, split, result.loss, result.tokens, _rows(batch), result.weights,
                          result.terms)
        return result.loss

    @override
    def predict_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """The model's predictions of the batch (for a language model: per-token target log-probabilities,
        next-token ids and the target mask), identical on every rank of a replica and row for row the batch Lightning
        gave this process (:meth:`~lightning_mp_lstm.pipeline.engine.PipelineEngine.predict`)."""
        with self.precision_plugin.predict_step_context():
            return self.engine.predict(batch)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:  # a new epoch: the stream starts again
            self._check_same_batch(batch, f"the first batch of epoch {self.lightning_module.trainer.current_epoch}")
            self.engine.reset_state("train")
            self._metrics.start_epoch()
        if self._verifier is not None and not self._verifier.done:
            self._run_verification(batch)
        self._step_clock.tick(batch)

    def _check_same_batch(self, batch: Any, where: str) -> None:
        """Where processes share each replica's batch (pipeline or tensor parallel), check that they loaded one."""
        if self.engine.layout.processes_per_replica > 1:
            check_same_batch(batch, self.data_parallel_rank, where)

    @override
    def on_train_end(self) -> None:
        """Time every stage on its own process at the shape of the batch the step clock kept (a collective), off the
        training path, and report on rank 0."""
        batch = self._step_clock.take_batch()
        if batch is None:
            return
        with self.precision_plugin.forward_context():
            self._measurements = report.measure(self.engine, batch, self.root_device, self._step_clock.intervals)
        rank_zero_info(report.measured_line(self.plan, self._measurements, self._step_clock.after_steps))

    def _run_verification(self, batch: Any) -> None:
        from lightning_mp_lstm.strategy.verify import STEPS, VerificationError  # only when verifying

        module = self.lightning_module
        layout = self.engine.layout
        title = (f"mp_lstm verify: {type(module).__name__}.training_step on one process against the pipeline "
                 f"(data x pipeline x tensor = {layout.data_parallel_size} x {layout.pipeline_parallel_size} x "
                 f"{layout.tensor_parallel_size}, {layout.schedule}, {layout.n_microbatches} microbatches), {STEPS} "
                 "steps on the first training batch, random draws equal")
        started = time.perf_counter()
        comparison = self._verifier.run(self.engine, module, batch, module.trainer, title, self.root_device,
                                        self.precision_plugin.convert_module,
                                        self.precision_plugin.inner.train_step_context)
        self.verification = comparison
        if not comparison.ok:
            raise VerificationError(comparison.table())
        self._metrics.log_as(comparison.names, comparison.flags)
        rank_zero_info(f"{comparison.table()} ({time.perf_counter() - started:.2f} s)")

    @override
    def on_validation_start(self) -> None:
        self.engine.reset_state("eval")

    on_test_start = on_predict_start = on_validation_start  # every evaluation starts the stream again


def _rows(batch: Any) -> int:
    """Sequences in this replica's batch (for Lightning's logging weights)."""
    return int(batch[0].shape[0])
