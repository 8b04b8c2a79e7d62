"""A training run's data (`train.train`'s): where it is read, in an input process of its own
(`data/input_process.py`) or in the run's process (the train data on a thread), its
iterators, and what the run knows of its batches before the first: the model features'
lengths (`batch_shapes.model_feature_lengths`, else the input process's answer) and the
shapes the first step compiles for."""

from __future__ import annotations

import sys
from typing import Any

import jax

from flaxlm.checkpoints import data_state
from flaxlm.data import input_process as input_process_lib
from flaxlm.data.config import DatasetConfig, batch_structs
from flaxlm.models import batch_shapes
from flaxlm.models.base import BaseModel
from flaxlm.models.row_start import RowStart
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import checks
from flaxlm.training import objective as objective_lib


def reads_in_own_process(
    setting: bool | None,
    model: BaseModel,
    cfgs: tuple[DatasetConfig | None, ...],
    objective: objective_lib.RunObjective,
    row_start: RowStart,
) -> bool:
    """Whether the run reads its data in an input process of its own
    (`input_process.py`; `train.input_process`). None: where it can, and this process has
    not loaded TensorFlow (a Gin file or task module that did means its input pipeline
    may need this process: read here)."""
    why_not = None
    if batch_shapes.converter_reference(model) is None:
        why_not = "the model names its feature converter as a class"
    elif any(cfg is not None and cfg.feature_converter is not None for cfg in cfgs):
        why_not = "a DatasetConfig.feature_converter is set (its class loaded TensorFlow)"
    elif row_start.hf_form:
        why_not = "the rows start as the task's HF tokenizer says (its vocabulary is read here)"
    elif objective is not objective_lib.NEXT_TOKEN_PREDICTION:
        why_not = "train.objective is not next-token prediction"
    if setting is None:
        return why_not is None and "tensorflow" not in sys.modules
    if setting and why_not:
        raise ValueError(
            f"train.input_process=True, but {why_not}: such a run reads its data in its own "
            "process. Leave train.input_process unset (or False)."
        )
    return setting


class TrainData:
    """Where a training run reads its data (`own_process`), with which converter
    (`converter`: a factory, or in the input process the model's converter's
    "module:Class"), and the model features' lengths (`feature_lengths`; None until the
    input process says, where only its pipeline knows them). All decided before any device
    work; `open` then starts reading, and `close` ends it whatever happened (`abort` first
    where something failed)."""

    def __init__(
        self,
        model: BaseModel,
        partitioner: Partitioner,
        train_cfg: DatasetConfig,
        eval_cfg: DatasetConfig | None,
        objective: objective_lib.RunObjective,
        row_start: RowStart,
        input_process: bool | None,
        model_dir: str,
    ) -> None:
        self.model, self.partitioner, self.row_start = model, partitioner, row_start
        self.own_process = reads_in_own_process(
            input_process, model, (train_cfg, eval_cfg), objective, row_start
        )
        if self.own_process:
            self.converter: Any = batch_shapes.converter_reference(model)
        else:
            input_process_lib.discard_early()
            pipeline = input_process_lib.load_pipeline()
            self.converter = pipeline.converter_for(train_cfg, model, row_start)
            objective.check_data(self.converter)
        self.feature_lengths: dict[str, int] | None = None
        self._take_feature_lengths(
            batch_shapes.model_feature_lengths(
                self.converter, train_cfg.task_feature_lengths, train_cfg.pack
            )
        )
        data_state.check_resumed_lengths(train_cfg.task_feature_lengths, model_dir)
        # (a resumed run reads the logical input shards its checkpoint saved)
        self.train_cfg = data_state.resumed_input_shards(train_cfg, partitioner, model_dir)
        self.eval_cfg = eval_cfg
        self.inputs: input_process_lib.InputProcess | None = None
        self.train_iter: Any = None
        self.eval_iter: Any = None

    def _take_feature_lengths(self, lengths: dict[str, int] | None) -> None:
        """The model features' lengths, once known (None: not yet), held to the model's
        sequence split."""
        if lengths is not None:
            checks.check_sequence_split(self.model, self.partitioner, lengths)
        self.feature_lengths = lengths

    def open(self) -> None:
        """The train iterator (built from now on) and the eval iterator (built at the first
        evaluation; its task looked up at once), read through the input process or here
        (the train data on a thread); the features' lengths where only the input process
        knows them."""
        if self.own_process:
            self.inputs = inputs = input_process_lib.start()
            self.train_iter = input_process_lib.RemoteDataIterator(
                inputs,
                self.train_cfg,
                self.partitioner,
                self.converter,
                feature_lengths=self.feature_lengths,
            )
            self.eval_iter = self.eval_cfg and input_process_lib.RemoteDataIterator(
                inputs, self.eval_cfg, self.partitioner, self.converter, lazy=True
            )
        else:
            pipeline = input_process_lib.load_pipeline()
            from flaxlm.data import deferred  # (after load_pipeline: it loads seqio quietly)

            self.train_iter = deferred.BackgroundDataIterator(
                self.train_cfg, self.partitioner, self.converter
            )
            self.eval_iter = self.eval_cfg and deferred.DeferredDataIterator(
                self.eval_cfg,
                self.partitioner,
                pipeline.converter_for(self.eval_cfg, self.model, self.row_start),
            )
        if self.feature_lengths is None:
            self._take_feature_lengths(self.train_iter.feature_shapes()[0])

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct] | None:
        """The training batches' shapes, dtypes and shardings (what the first step compiles
        for), or None where a feature is not one row of tokens an example
        (`pipeline.batch_dtypes`)."""
        if self.inputs is None:
            dtypes = input_process_lib.load_pipeline().batch_dtypes(self.train_cfg, self.converter)
        else:
            dtypes = self.train_iter.feature_shapes()[1]
        if dtypes is None:
            return None
        return batch_structs(self.train_cfg, self.feature_lengths, dtypes, self.partitioner)

    def check_eval_task(self) -> None:
        """Waits for the input process's look-up of the eval task: a misnamed one raised
        before the first step, not at the first evaluation."""
        if self.inputs is not None and self.eval_iter is not None:
            self.eval_iter.check()

    def fresh_iterators(self) -> tuple[Any, Any]:
        """New in-process `DataIterator`s of the train and eval data (None without eval
        data): an objective's own passes over the data."""
        pipeline = input_process_lib.load_pipeline()
        return tuple(
            pipeline.DataIterator.create(cfg, self.partitioner, self.converter) if cfg else None
            for cfg in (self.train_cfg, self.eval_cfg)
        )

    def abort(self) -> None:
        """Ends a failed run's input process at once: it has nothing left to do."""
        if self.inputs is not None:
            self.inputs.kill()

    def close(self) -> None:
        """Ends the input process (once it has read that there is nothing more to ask), or
        waits for the data thread (a failed set-up's ends before the process does)."""
        if self.inputs is not None:
            self.inputs.close()
        elif self.train_iter is not None:
            self.train_iter.wait()
