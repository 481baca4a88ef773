"""GGUF weights kept in their ggml blocks: the linear layers', the embedding's and the LM head's storage and kernels.

A layer whose checkpoint tensors are all float in the file (F32, F16, BF16) stays an ordinary float layer in the
model dtype. Any other layer holds its weight as one flat uint8 `weight` parameter: the shards of a fused layer (q,
k, v or gate, up) are grouped into runs of one type (Q4_K_M files mix Q4_K and Q6_K inside one fused QKV), each run a
`[rows, row_bytes]` block matrix (float runs: a `[rows, columns]` matrix in the model dtype) at a 64-byte aligned
offset, so a layer's bytes are its file tensors' bytes and no dequantized copy exists. `apply` runs one kernel per run
(`kvflow.kernels.quant.ggml_linear_for`, chosen when the layer is built) and concatenates the runs' outputs; which
product each block type runs above the GEMV's rows is measured on the runs' shapes when the plan applies
(`kvflow.kernels.quant_choice`).

Q5_0 and Q5_K (llama.cpp's Q4_K_M stores Q5_0 where a row is no whole number of 256-element blocks; the Q5_K_S /
Q5_K_M mixes use Q5_K) have no kernel of their own: `GGUFCheckpoint` converts them as they load to Q8_0 blocks
(`ggml_quantize.to_q8_0`), which this plan then keeps and runs like any Q8_0 tensor. Q5_0 -> Q8_0 is exact (the same
fp16 scale, q - 16 as the int8); Q5_K's affine sub-blocks are requantized, within about half a Q8_0 step of the
file's weights. The cost is memory: a Q8_0 block takes 34 bytes per 32 weights against Q5_0's 22 and Q5_K's 27.5
(176 per 256), so those tensors are held at 1.55x (Q5_0) / 1.24x (Q5_K) their bytes in the file. The simpler choice
than a 5-bit kernel (one more block type in the C++ products) for tensors that are a small share of a Q4_K_M file.

A mixture-of-experts layer (`FusedMoE`) keeps its experts on the file's blocks too (`FusedMoE.quantize_experts`:
`[experts, rows, row_bytes]` stacks of gate/up and of down, the file's bytes), run per layer in one C++ call on the
dense products (`kvflow.kernels.quant.fused_moe`); its router is float.

Weight updates (`strict=False` loads of float tensors) into quantized storage are refused with the tensor's name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import quant
from kvflow.kernels.quant_choice import activation_dtype, choose_quant_gemm_plans
from kvflow.models.layers.fused_moe import FusedMoE
from kvflow.models.layers.linear import FusedProduct, Linear, LinearMethod, QuantRun
from kvflow.models.layers.vocab import LMHead, VocabEmbedding
from kvflow.models.layers.weights import (
    CheckpointTensor,
    WeightShapeError,
    copy_checked,
    narrow,
    set_weight_loader,
)
from kvflow.models.loader import EMBEDDING, LM_HEAD, PackedNames
from kvflow.models.quantization import GGUF
from kvflow.models.quantization.gguf_file import FLOAT_TYPES, GGUFTensor, GGUFTensorInfo

logger = logging.getLogger(__name__)

_ALIGNMENT = (
    64  # bytes: each run's storage starts on a cache line (and a float run's on its element size)
)
GGMLLinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass
class _Run:
    """Consecutive shards of one type: rows `[row_start, row_start + rows)` of the layer's output, stored at
    `offset` of the flat weight as `rows` block rows (or float rows)."""

    qtype: str
    shards: list[int | None]
    row_start: int
    rows: int
    columns: int
    offset: int
    num_bytes: int
    matrix: torch.Tensor | None = None  # the view into the flat weight, set once it exists

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_TYPES


def _run_bytes(qtype: str, rows: int, columns: int, dtype: torch.dtype) -> int:
    if qtype in FLOAT_TYPES:
        return rows * columns * torch.empty((), dtype=dtype).element_size()
    return rows * quant.ggml_row_bytes(qtype, columns)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGNMENT) * _ALIGNMENT


class GGUFLinear(LinearMethod):
    """The `LinearMethod` of a layer stored as GGUF blocks (see the module docstring)."""

    name = GGUF

    def __init__(self, layer: Linear, shard_types: list[tuple[int | None, str]], name: str) -> None:
        self.layer = layer
        self.layer_name = name
        dtype = layer.weight.dtype
        columns = layer.input_size
        self.runs: list[_Run] = []
        offset = row_start = 0
        for shard, qtype in shard_types:
            rows = layer.output_sizes[0 if shard is None else shard]
            if self.runs and self.runs[-1].qtype == qtype:
                run = self.runs[-1]
                run.shards.append(shard)
                run.rows += rows
                run.num_bytes = _run_bytes(qtype, run.rows, columns, dtype)
            else:
                if self.runs:
                    offset = _aligned(self.runs[-1].offset + self.runs[-1].num_bytes)
                try:
                    num_bytes = _run_bytes(qtype, rows, columns, dtype)
                except ValueError as error:
                    raise ValueError(f"{name}: {error}") from None
                self.runs.append(_Run(qtype, [shard], row_start, rows, columns, offset, num_bytes))
            row_start += rows
        total = self.runs[-1].offset + self.runs[-1].num_bytes
        layer.weight = nn.Parameter(
            torch.zeros(total, dtype=torch.uint8, device=layer.weight.device), requires_grad=False
        )
        set_weight_loader(layer.weight, self.weight_loader)
        for run in self.runs:
            flat = layer.weight.data[run.offset : run.offset + run.num_bytes]
            run.matrix = (
                flat.view(dtype).view(run.rows, columns)
                if run.is_float
                else flat.view(run.rows, quant.ggml_row_bytes(run.qtype, columns))
            )
        self._kernels: list[GGMLLinearFn | None] = [
            None if run.is_float else quant.ggml_linear_for(run.qtype) for run in self.runs
        ]
        # Every run's product on the C++ kernels: the fused decode layer can run them (`fused_decode_product`).
        self._on_kernels = quant.kernels_in_use() and not any(run.is_float for run in self.runs)
        self._dtype = dtype

    @property
    def kernel_names(self) -> list[str]:
        return ["float" if fn is None else getattr(fn, "__name__", "?") for fn in self._kernels]

    def fused_decode_product(self) -> FusedProduct | None:
        """The runs on the kernels, each with its rows of the bias; None when a run is float or the products are
        the reference. `max_rows`: the fewest of the runs' types (`quant.kernel_rows`)."""
        if not self._on_kernels:
            return None
        bias = self.layer.bias
        runs = []
        limits = []
        for run in self.runs:
            assert run.matrix is not None
            rows = quant.kernel_rows(run.qtype)
            runs.append(
                QuantRun(
                    weight=run.matrix,
                    type_code=quant.kernel_type_code(run.qtype),
                    scale=None,
                    bias=None if bias is None else bias[run.row_start : run.row_start + run.rows],
                    gemv_max_rows=rows.gemv_max_rows,
                )
            )
            if rows.max_rows is not None:
                limits.append(rows.max_rows)
        return FusedProduct(runs=tuple(runs), max_rows=min(limits, default=None))

    def _place(self, shard_id: int | None) -> tuple[_Run, slice]:
        for run in self.runs:
            if shard_id in run.shards:
                before = sum(
                    self.layer.output_sizes[0 if shard is None else shard]
                    for shard in run.shards[: run.shards.index(shard_id)]
                )
                rows = self.layer.output_sizes[0 if shard_id is None else shard_id]
                return run, slice(before, before + rows)
        raise ValueError(
            f"{self.layer_name}: the GGUF file's layout has no shard {shard_id} for this layer"
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        """Copy this rank's rows (or block-aligned columns) of shard `shard_id`'s GGUF tensor into its run."""
        run, rows = self._place(shard_id)
        assert run.matrix is not None
        part = narrow(loaded_weight, self.layer.checkpoint_index("weight", shard_id))
        if run.is_float:
            if isinstance(part, GGUFTensor):
                raise WeightShapeError(f"expected a float tensor, got {part.qtype} blocks")
            copy_checked(run.matrix[rows], part)
            return
        if not isinstance(part, GGUFTensor):
            raise ValueError(
                f"{self.layer_name}: its weight is stored as GGUF {run.qtype} blocks; loading float weights "
                "into it (a weight update) is not supported"
            )
        if part.qtype != run.qtype:
            raise WeightShapeError(f"file type {part.qtype}, model expects {run.qtype}")
        destination = run.matrix[rows]
        if (destination.shape[0], run.columns) != part.shape:
            raise WeightShapeError(
                f"checkpoint {part.shape}, model {(destination.shape[0], run.columns)}"
            )
        copy_checked(destination, part.data)

    def apply(self, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outputs = []
        for run, kernel in zip(self.runs, self._kernels, strict=True):
            assert run.matrix is not None
            run_bias = None if bias is None else bias[run.row_start : run.row_start + run.rows]
            if kernel is None:
                outputs.append(F.linear(hidden_states, run.matrix, run_bias))
            else:
                outputs.append(kernel(hidden_states, run.matrix, run_bias))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


class GGUFVocab(LinearMethod):
    """The embedding table (and the LM head, tied or its own) stored as GGUF blocks: `weight` is uint8
    `[rows, row_bytes]` laid out like the float table (this rank's vocabulary rows first); `lookup` dequantizes just
    the looked-up rows, `apply` is the head's matmul on the blocks."""

    name = GGUF

    def __init__(self, vocab: VocabEmbedding | LMHead, qtype: str, dtype: torch.dtype) -> None:
        self.vocab = vocab
        self.qtype = qtype
        self.dtype = dtype
        rows, columns = vocab.weight.shape
        vocab.weight = nn.Parameter(
            torch.zeros(
                rows,
                quant.ggml_row_bytes(qtype, columns),
                dtype=torch.uint8,
                device=vocab.weight.device,
            ),
            requires_grad=False,
        )
        set_weight_loader(vocab.weight, self.weight_loader)
        self._linear = quant.ggml_linear_for(qtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        part = narrow(loaded_weight, self.vocab.checkpoint_index("weight", shard_id))
        if not isinstance(part, GGUFTensor) or part.qtype != self.qtype:
            raise ValueError(
                f"the vocabulary table is stored as GGUF {self.qtype} blocks; got "
                f"{getattr(part, 'qtype', 'float weights')} (weight updates are not supported)"
            )
        copy_checked(param.data[: self.vocab.num_vocab_rows], part.data)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() == 1:  # the flat batch: no reshape or view to make
            return quant.dequantize(
                self.qtype, self.vocab.weight.index_select(0, input_ids), self.dtype
            )
        rows = self.vocab.weight.index_select(0, input_ids.reshape(-1))
        embedded = quant.dequantize(self.qtype, rows, self.dtype)
        return embedded.view(*input_ids.shape, embedded.shape[-1])

    def apply(self, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._linear(hidden_states, self.vocab.weight, bias)


class GGUFPlan:
    """Lays a model out as a GGUF file's tensors say (`infos`: Hugging Face name -> the file's tensor)."""

    name = GGUF

    def __init__(self, infos: dict[str, GGUFTensorInfo]) -> None:
        self.infos = infos

    def apply(self, model: nn.Module) -> None:
        names = PackedNames(getattr(model, "packed_modules_mapping", {}))
        counts: dict[str, int] = {}
        shapes: dict[str, set[tuple[int, int]]] = {}
        for module_name, module in model.named_modules():
            if not isinstance(module, Linear):
                continue
            param_name = f"{module_name}.weight"
            shard_types = []
            for shard in names.shards(param_name):
                checkpoint_name = names.checkpoint_name(param_name, shard)
                info = self.infos.get(checkpoint_name)
                if info is None:
                    raise ValueError(f"the GGUF file has no tensor for {checkpoint_name}")
                shard_types.append((shard, info.qtype))
            for _, qtype in shard_types:
                counts[qtype] = counts.get(qtype, 0) + 1
            if all(qtype in FLOAT_TYPES for _, qtype in shard_types):
                continue  # an ordinary float layer
            method = GGUFLinear(module, shard_types, module_name)
            module.quant_method = method
            for run in method.runs:
                if not run.is_float:
                    shapes.setdefault(run.qtype, set()).add((run.rows, run.columns))
        # Before the model picks its fast paths: the fused decode layer's row limit follows the measured plans.
        choose_quant_gemm_plans(shapes, dtype=activation_dtype(model))
        self._apply_vocab(model)
        self._apply_experts(model, counts)
        logger.info(
            "GGUF weights kept in their blocks: %s",
            ", ".join(f"{count} {qtype}" for qtype, count in sorted(counts.items())),
        )

    def _apply_experts(self, model: nn.Module, counts: dict[str, int]) -> None:
        """Every mixture-of-experts layer's experts on the file's blocks (`FusedMoE.quantize_experts`: gate and up
        of one type, down of one type, for every expert; the model's `checkpoint_target` maps the file's names).
        Float experts in the file stay float, and so (dequantized as they load, with a warning) do experts whose
        gate and up types differ."""
        target_of = getattr(model, "checkpoint_target", None)
        if target_of is None:
            return
        # FusedMoE name -> "w13" / "w2" -> the file's types
        types: dict[str, dict[str, set[str]]] = {}
        for hf_name, info in self.infos.items():
            target = target_of(hf_name)
            if target is None:
                continue
            module_name, _, param_name = target[0].rpartition(".")
            if param_name in ("w13_weight", "w2_weight"):
                types.setdefault(module_name, {}).setdefault(param_name[:-7], set()).add(info.qtype)
        for module_name, found in types.items():
            layer = model.get_submodule(module_name)
            assert isinstance(layer, FusedMoE)
            w13_types, w2_types = found.get("w13", set()), found.get("w2", set())
            key = f"{'/'.join(sorted(w13_types | w2_types))} experts"
            counts[key] = counts.get(key, 0) + 1
            if any(qtype in FLOAT_TYPES for qtype in w13_types | w2_types):
                if not (w13_types | w2_types) <= FLOAT_TYPES.keys():
                    logger.warning("%s: experts of types %s kept in float", module_name, key)
                continue
            if len(w13_types) != 1 or len(w2_types) != 1:
                logger.warning(
                    "%s: experts of several types (gate/up %s, down %s) kept in float (dequantized as they "
                    "load)",
                    module_name,
                    sorted(w13_types),
                    sorted(w2_types),
                )
                continue
            layer.quantize_experts(w13_types.pop(), w2_types.pop())

    def _apply_vocab(self, model: nn.Module) -> None:
        embedding = model.get_submodule("model.embed_tokens")
        head = model.get_submodule("lm_head")
        assert isinstance(embedding, VocabEmbedding) and isinstance(head, LMHead)
        tied = head.weight is embedding.weight
        dtype = embedding.weight.dtype
        embedding_type = self.infos[EMBEDDING].qtype
        if embedding_type not in FLOAT_TYPES:
            embedding.quant_method = GGUFVocab(embedding, embedding_type, dtype)
        if tied:
            head.tie(embedding)
            if embedding_type not in FLOAT_TYPES:
                head.quant_method = embedding.quant_method
            return
        head_info = self.infos.get(LM_HEAD)
        if head_info is not None and head_info.qtype not in FLOAT_TYPES:
            head.quant_method = GGUFVocab(head, head_info.qtype, dtype)

    def after_loading(self, model: nn.Module) -> None:
        return None
