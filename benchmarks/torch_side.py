"""HF transformers' PyTorch models trained as flaxlm trains its own: the torch side of
train_step.py (GPT-J on CPU) and accelerator.py (Llama on a GPU, compiled).

flaxlm's optimizer (`optimizers.create_optimizer` defaults): AdamW b1 0.9, b2 0.95, eps 1e-8,
lr 1e-3, weight decay 0.1 on every param but biases and norm scales (here: every 1-D param,
the same set), after global-norm clipping at 1.0; the loss is the mean token cross-entropy
of every position, in float32.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

LEARNING_RATE = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
ADAMW_IMPLEMENTATIONS = ("default", "for-loop", "foreach", "fused")


def rotary_dim(hidden_size: int, num_heads: int) -> int:
    """flaxlm's and HF's rotary width for this shape (train_step.build_model uses it too)."""
    head_dim = hidden_size // num_heads
    return min(32, head_dim - head_dim % 2)


def gptj(shape: Mapping[str, int], vocab_size: int) -> Any:
    """A random `GPTJForCausalLM` of train_step.py's shape (dropout off, untied head)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTJConfig(
        vocab_size=vocab_size,
        n_positions=max(2048, shape["seq_len"]),
        n_embd=shape["hidden_size"],
        n_layer=shape["num_layers"],
        n_head=shape["num_heads"],
        rotary_dim=rotary_dim(shape["hidden_size"], shape["num_heads"]),
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=1,
    )
    return transformers.GPTJForCausalLM(config)


class TorchSide:
    """An HF causal LM with flaxlm's optimizer, advanced `n` steps at a time on `device`.

    threads (CPU): `torch.set_num_threads` (None: every core). adamw: torch's own choice
    ('default': for-loop on CPU, foreach on CUDA), or 'for-loop', 'foreach', 'fused'. dtype
    'bfloat16': the forward under autocast (params and optimizer float32, as flaxlm's `dtype`
    option). remat: HF's gradient checkpointing (every block recomputed in backward).
    compile: `torch.compile` of the forward and loss (the backward through AOTAutograd).
    """

    def __init__(
        self,
        model: Any,
        batch: Mapping[str, Any],
        *,
        threads: int | None = None,
        adamw: str = "default",
        dtype: str = "float32",
        remat: bool = False,
        device: str = "cpu",
        compile: bool = False,
    ) -> None:
        import torch

        if adamw not in ADAMW_IMPLEMENTATIONS:
            raise ValueError(f"adamw {adamw!r}: expected one of {ADAMW_IMPLEMENTATIONS}.")
        if device == "cpu":
            torch.set_num_threads(threads or os.cpu_count() or 1)
        self.torch = torch
        self.device = device
        self.model = model.to(device).train()
        self.model.config.use_cache = False
        if remat:  # HF's gradient checkpointing, "activation checkpointing" from v5 on
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        impl = {
            "default": {},
            "for-loop": {"foreach": False},
            "foreach": {"foreach": True},
            "fused": {"fused": True},
        }[adamw]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": WEIGHT_DECAY},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=LEARNING_RATE,
            betas=BETAS,
            eps=EPS,
            **impl,
        )
        self.clip_foreach = True if adamw in ("foreach", "fused") else None
        self.autocast = dtype == "bfloat16"
        self.inputs = torch.from_numpy(np.asarray(batch["decoder_input_tokens"], np.int64))
        self.labels = torch.from_numpy(np.asarray(batch["decoder_target_tokens"], np.int64))
        self.inputs, self.labels = self.inputs.to(device), self.labels.to(device)
        if compile:  # inductor's hint that TF32 is off splits the progress lines; autocast
            # runs the layers' matmuls in bf16 (HF keeps its rotary table float32 on purpose)
            warnings.filterwarnings("ignore", "TensorFloat32 tensor cores", UserWarning)
        self.loss_fn = torch.compile(self._loss) if compile else self._loss
        self.loss = float("nan")
        self.first_loss: float | None = None
        self.description = {
            "torch_version": torch.__version__,
            "transformers_version": __import__("transformers").__version__,
            "device": device,
            "threads": torch.get_num_threads(),
            "adamw": adamw,
            "attention": self.model.config._attn_implementation,
            "autocast_bfloat16": self.autocast,
            "gradient_checkpointing": remat,
            "torch_compile": compile,
            "decayed_params": sum(p.numel() for p in decay),
            "undecayed_params": sum(p.numel() for p in no_decay),
        }

    def _loss(self, inputs: Any, labels: Any) -> Any:
        torch = self.torch
        autocast = (
            torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )
        with autocast:
            logits = self.model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def step(self) -> Any:
        """One step; its loss as a tensor (reading it waits for the device)."""
        loss = self.loss_fn(self.inputs, self.labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), CLIP_NORM, foreach=self.clip_foreach
        )
        self.opt.step()
        return loss.detach()

    def run(self, n: int) -> float:
        """`n` steps; their wall time in seconds (the device's work included)."""
        start = time.perf_counter()
        for _ in range(n):
            loss = self.step()
            if self.first_loss is None:
                self.first_loss = float(loss)  # the untrained model's (waits once)
        self.loss = float(loss)  # waits for the last step
        return time.perf_counter() - start
