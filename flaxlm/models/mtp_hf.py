"""The HuggingFace tables of multi-token-prediction layers (`mtp.py`): where the Hub's
DeepSeek-V3 and GLM-4.5 files keep them, decoder layers `num_hidden_layers + k`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flaxlm.models.hf_spec import HFTensor, linear


def relayered(
    table: list[HFTensor],
    scope: str,
    index: int,
    rename: Callable[[str], str] = lambda name: name,
) -> list[HFTensor]:
    """The records of one block (`{i}` in their names, `layers_{i}/...` params) for the block
    at param scope `scope` and HF layer `index`, each HF name (and piece) then `rename`d
    (a family whose files keep MTP layers apart from the decoder's: `mtp.layers.0.`)."""
    out = []
    for t in table:
        if not t.param.startswith("layers_{i}/"):
            continue
        out.append(
            dataclasses.replace(
                t,
                param=scope + t.param[len("layers_{i}") :],
                hf=rename(t.hf.replace("{i}", str(index))),
                pieces=tuple(rename(p.replace("{i}", str(index))) for p in t.pieces),
                layers=0,
                only=None,
            )
        )
    return out


def tensors(num_layers: int, depths: int, block_table: list[HFTensor]) -> list[HFTensor]:
    """The records of `depths` MTP layers after `num_layers` decoder layers: each one's norms,
    projection and block (`block_table`: an all-MoE config's records of one layer `{i}`)."""
    out = []
    for k in range(depths):
        scope, i = f"mtp_{k}", num_layers + k
        prefix = f"model.layers.{i}"
        out += [
            HFTensor(f"{scope}/enorm/scale", f"{prefix}.enorm.weight"),
            HFTensor(f"{scope}/hnorm/scale", f"{prefix}.hnorm.weight"),
            linear(f"{scope}/eh_proj/kernel", f"{prefix}.eh_proj.weight"),
            HFTensor(f"{scope}/post_norm/scale", f"{prefix}.shared_head.norm.weight"),
            *relayered(block_table, f"{scope}/block", i),
        ]
    return out


def copies(num_layers: int, depths: int) -> list[str]:
    """Patterns of what the Hub's MTP layers also hold, not read: their copies of the
    embedding and the head."""
    return [
        rf"^model\.layers\.{num_layers + k}\.(embed_tokens|shared_head\.head)\.weight$"
        for k in range(depths)
    ]


def block_table(cfg: Any, family_tensors: Callable[[Any], list[HFTensor]]) -> list[HFTensor]:
    """`family_tensors` of a one-layer copy of `cfg` with the MTP block's fields
    (`MtpOptions.mtp_block_fields`): an MTP block's records, layer `{i}`."""
    one = dataclasses.replace(
        cfg, num_layers=1, num_mtp_layers=0, mtp_loss_weight=0.0, **cfg.mtp_block_fields()
    )
    return family_tensors(one)


def tables(cfg: Any, family_tensors: Callable[[Any], list[HFTensor]]) -> list[HFTensor]:
    """The records of `cfg`'s MTP layers, each block's from `block_table`."""
    if not cfg.num_mtp_layers:
        return []
    return tensors(cfg.num_layers, cfg.num_mtp_layers, block_table(cfg, family_tensors))


def spec_fields(cfg: Any, ignore: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`HFSpec.config_fields` of a family whose files carry MTP layers: with `cfg`'s, the
    layers read (the family's `skip` but the MTP layer's: `skip`, a multimodal file's other
    towers) and their copies of the embedding and head passed over (beside the family's
    `ignore`)."""
    if not cfg.num_mtp_layers:
        return {}
    return dict(skip=skip, ignore=(*ignore, *copies(cfg.num_layers, cfg.num_mtp_layers)))
