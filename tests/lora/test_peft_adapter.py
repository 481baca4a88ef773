"""`load_peft_adapter` against adapters PEFT itself saved on tiny random Llama and Phi-3 checkpoints.

The loaded A and B are checked against PEFT's tensors (B times PEFT's scaling), and each layer part's `B @ A`
against what PEFT's own merge adds to that projection's weight (merged minus base, float32). The layer layout
(`lora_modules`, `part_sizes`, `input_sizes`) is read off the kvflow model built from the same checkpoint, as the
engine would. Every refusal names what it refuses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow.lora.peft_adapter import LoRAModuleWeights, PEFTAdapter, load_peft_adapter
from kvflow.models.layers.linear import Linear
from kvflow.models.loader import load_model
from kvflow.testing.hf_checkpoints import load_hf_model
from tests.lora.adapters import (
    ALL_LINEAR,
    make_peft_adapter,
    make_tiny_llama,
    make_tiny_phi3,
    merged_model,
)

LORA_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Layout:
    """A base checkpoint and its kvflow model's adaptable layers, as the engine would pass them."""

    path: Path
    packed_modules_mapping: Mapping[str, list[str]]
    lora_modules: dict[str, int]
    part_sizes: dict[str, tuple[int, ...]]
    input_sizes: dict[str, int]

    def load(self, adapter: Path, **overrides: Any) -> PEFTAdapter:
        kwargs: dict[str, Any] = {
            "packed_modules_mapping": self.packed_modules_mapping,
            "lora_modules": self.lora_modules,
            "max_lora_rank": 16,
            "dtype": torch.float32,
            "part_sizes": self.part_sizes,
            "input_sizes": self.input_sizes,
            **overrides,
        }
        return load_peft_adapter(adapter, **kwargs)

    def checkpoint_name(self, module_name: str, part: int) -> str:
        """The Hugging Face module path of part `part` of kvflow layer `module_name` (Llama naming)."""
        parent, _, leaf = module_name.rpartition(".")
        parts = self.packed_modules_mapping.get(leaf)
        return f"{parent}.{parts[part]}" if parts else module_name


def _layout(path: Path) -> Layout:
    model = load_model(path)
    layers = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rpartition(".")[2] in LORA_LAYERS
    }
    return Layout(
        path=path,
        packed_modules_mapping=type(model).packed_modules_mapping,
        lora_modules={name: len(layer.output_sizes) for name, layer in layers.items()},
        part_sizes={name: layer.output_sizes for name, layer in layers.items()},
        input_sizes={name: layer.input_size for name, layer in layers.items()},
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    return _layout(make_tiny_llama(tmp_path_factory.mktemp("llama") / "base"))


@pytest.fixture(scope="module")
def llama_reference(llama: Layout) -> Any:
    return load_hf_model(llama.path)


def _peft_tensors(adapter: Path) -> dict[str, torch.Tensor]:
    return load_file(str(adapter / "adapter_model.safetensors"))


def _rewrite(adapter: Path, *, config: dict[str, Any] | None = None, tensors: Any = None) -> Path:
    """Change an adapter folder in place: merge `config` into adapter_config.json, replace the tensors."""
    if config is not None:
        path = adapter / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
    return adapter


def _assert_deltas_match_merge(layout: Layout, adapter: PEFTAdapter, adapter_path: Path) -> None:
    """Every part's B @ A (zero where untargeted) equals PEFT's merged weight minus the base weight."""
    merged = merged_model(layout.path, adapter_path).state_dict()
    base = load_hf_model(layout.path).state_dict()
    for module_name, num_parts in layout.lora_modules.items():
        weights = adapter.modules.get(module_name)
        for part in range(num_parts):
            key = f"{layout.checkpoint_name(module_name, part)}.weight"
            expected = merged[key] - base[key]
            delta = None if weights is None else weights.delta_weight(part)
            if delta is None:
                assert torch.equal(expected, torch.zeros_like(expected)), key
            else:
                torch.testing.assert_close(delta, expected, atol=2e-6, rtol=1e-5, msg=key)


TARGET_SETS = {
    "q_v": ("q_proj", "v_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all_linear": ALL_LINEAR,
}


@pytest.mark.parametrize("targets", list(TARGET_SETS.values()), ids=list(TARGET_SETS))
def test_target_sets_load_into_packed_parts_and_match_peft(
    llama: Layout, tmp_path: Path, targets: tuple[str, ...]
) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=targets)
    adapter = llama.load(path)
    peft_tensors = _peft_tensors(path)
    scaling = 16 / 8

    assert adapter.rank == 8
    assert adapter.target_modules == frozenset(targets)
    seen = set()
    for module_name, num_parts in llama.lora_modules.items():
        weights = adapter.modules.get(module_name)
        for part in range(num_parts):
            checkpoint_name = llama.checkpoint_name(module_name, part)
            targeted = checkpoint_name.rpartition(".")[2] in targets
            if not targeted:
                assert weights is None or (
                    weights.lora_a[part] is None and weights.lora_b[part] is None
                )
                continue
            assert weights is not None and weights.module_name == module_name
            assert len(weights.lora_a) == len(weights.lora_b) == num_parts
            lora_a = peft_tensors[f"{PEFT_PREFIX}{checkpoint_name}.lora_A.weight"]
            lora_b = peft_tensors[f"{PEFT_PREFIX}{checkpoint_name}.lora_B.weight"]
            assert torch.equal(weights.lora_a[part], lora_a)
            torch.testing.assert_close(weights.lora_b[part], lora_b * scaling, atol=0, rtol=0)
            seen.add(checkpoint_name)
    assert len(seen) == 2 * len(targets)
    expected_bytes = sum(tensor.numel() * 4 for tensor in peft_tensors.values())
    assert adapter.num_bytes == expected_bytes
    _assert_deltas_match_merge(llama, adapter, path)


def test_k_proj_is_part_one_of_qkv_proj(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["k_proj", "up_proj"])
    adapter = llama.load(path)
    qkv = adapter.modules["model.layers.0.self_attn.qkv_proj"]
    assert [a is not None for a in qkv.lora_a] == [False, True, False]
    assert qkv.lora_b[1] is not None and qkv.lora_b[1].shape == (32, 8)  # 2 KV heads of 16
    gate_up = adapter.modules["model.layers.1.mlp.gate_up_proj"]
    assert [b is not None for b in gate_up.lora_b] == [False, True]
    assert set(adapter.modules) == {
        f"model.layers.{layer}.{name}"
        for layer in range(2)
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj")
    }


@pytest.mark.parametrize(
    ("r", "lora_alpha", "use_rslora", "scaling"),
    [
        (4, 8, False, 2.0),
        (16, 16, False, 1.0),
        (8, 32, True, 32 / math.sqrt(8)),
        (2, 3, True, 3 / math.sqrt(2)),
    ],
)
def test_scaling_is_multiplied_into_b(
    llama: Layout, tmp_path: Path, r: int, lora_alpha: float, use_rslora: bool, scaling: float
) -> None:
    path = make_peft_adapter(
        llama.path,
        tmp_path / "adapter",
        target_modules=["q_proj", "down_proj"],
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
    )
    adapter = llama.load(path)
    raw_b = _peft_tensors(path)[f"{PEFT_PREFIX}model.layers.1.mlp.down_proj.lora_B.weight"]
    down = adapter.modules["model.layers.1.mlp.down_proj"]
    assert adapter.rank == r and down.rank == r
    torch.testing.assert_close(down.lora_b[0], raw_b * scaling, atol=0, rtol=1e-6)
    _assert_deltas_match_merge(llama, adapter, path)


def test_rank_and_alpha_patterns_are_per_module(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(
        llama.path,
        tmp_path / "adapter",
        target_modules=["q_proj", "v_proj", "o_proj"],
        r=4,
        lora_alpha=8,
        rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 6},
        alpha_pattern={"model.layers.0.self_attn.q_proj": 3, "o_proj": 1},
    )
    adapter = llama.load(path)
    raw = _peft_tensors(path)
    qkv0 = adapter.modules["model.layers.0.self_attn.qkv_proj"]
    qkv1 = adapter.modules["model.layers.1.self_attn.qkv_proj"]
    assert [None if a is None else a.shape[0] for a in qkv0.lora_a] == [4, None, 2]
    assert [None if a is None else a.shape[0] for a in qkv1.lora_a] == [6, None, 2]
    assert adapter.rank == 6 and qkv0.rank == 4

    def raw_b(module: str) -> torch.Tensor:
        return raw[f"{PEFT_PREFIX}model.layers.{module}.lora_B.weight"]

    torch.testing.assert_close(
        qkv0.lora_b[0], raw_b("0.self_attn.q_proj") * (3 / 4), atol=0, rtol=1e-6
    )
    torch.testing.assert_close(
        qkv0.lora_b[2], raw_b("0.self_attn.v_proj") * (8 / 2), atol=0, rtol=1e-6
    )
    torch.testing.assert_close(
        qkv1.lora_b[0], raw_b("1.self_attn.q_proj") * (8 / 6), atol=0, rtol=1e-6
    )
    o_proj = adapter.modules["model.layers.1.self_attn.o_proj"]
    torch.testing.assert_close(
        o_proj.lora_b[0], raw_b("1.self_attn.o_proj") * (1 / 4), atol=0, rtol=1e-6
    )
    _assert_deltas_match_merge(llama, adapter, path)


def test_regex_target_modules(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(
        llama.path, tmp_path / "adapter", target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj"
    )
    adapter = llama.load(path)
    assert set(adapter.modules) == {"model.layers.1.self_attn.qkv_proj"}
    assert adapter.target_modules == frozenset({"q_proj", "v_proj"})
    _assert_deltas_match_merge(llama, adapter, path)
    # Tensors for a module the regex does not select: the adapter contradicts its own config.
    _rewrite(path, config={"target_modules": r".*\.layers\.1\.self_attn\.q_proj"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.v_proj'.*target_modules"):
        llama.load(path)


def test_dtype_adapter_name_infix_and_bin_file(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["q_proj", "up_proj"])
    reference = llama.load(path)
    half = llama.load(path, dtype=torch.bfloat16)
    assert half.num_bytes * 2 == reference.num_bytes
    for name, module in reference.modules.items():
        for ours, theirs in zip(half.modules[name].lora_b, module.lora_b, strict=True):
            assert (ours is None) == (theirs is None)
            if ours is not None:
                assert ours.dtype == torch.bfloat16
                torch.testing.assert_close(ours, theirs.to(torch.bfloat16), atol=0, rtol=0)

    tensors = _peft_tensors(path)
    infixed = {
        key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): tensor
        for key, tensor in tensors.items()
    }
    _rewrite(path, tensors=infixed)
    _assert_same(llama.load(path), reference)

    (path / "adapter_model.safetensors").unlink()
    torch.save(tensors, path / "adapter_model.bin")
    _assert_same(llama.load(path), reference)


def _assert_same(adapter: PEFTAdapter, reference: PEFTAdapter) -> None:
    assert adapter.modules.keys() == reference.modules.keys()
    assert adapter.rank == reference.rank and adapter.target_modules == reference.target_modules
    for name, module in reference.modules.items():
        _assert_same_module(adapter.modules[name], module)


def _assert_same_module(ours: LoRAModuleWeights, theirs: LoRAModuleWeights) -> None:
    for mine, other in zip(
        (*ours.lora_a, *ours.lora_b), (*theirs.lora_a, *theirs.lora_b), strict=True
    ):
        assert (mine is None and other is None) or torch.equal(mine, other)


def test_phi3_fused_targets_split_b_by_part_rows(tmp_path: Path) -> None:
    phi3 = _layout(make_tiny_phi3(tmp_path / "phi3"))
    path = make_peft_adapter(
        phi3.path, tmp_path / "adapter", target_modules=["qkv_proj", "gate_up_proj", "o_proj"], r=4
    )
    adapter = phi3.load(path)
    raw = _peft_tensors(path)
    assert adapter.target_modules == frozenset({"qkv_proj", "gate_up_proj", "o_proj"})
    qkv = adapter.modules["model.layers.0.self_attn.qkv_proj"]
    assert all(a is qkv.lora_a[0] for a in qkv.lora_a)  # one A for every part
    assert [b.shape for b in qkv.lora_b] == [(64, 4), (32, 4), (32, 4)]
    raw_b = raw[f"{PEFT_PREFIX}model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    torch.testing.assert_close(torch.cat(qkv.lora_b), raw_b * 4.0, atol=0, rtol=0)
    # The parts' deltas stacked are what PEFT's merge adds to the fused checkpoint weights.
    merged = merged_model(phi3.path, path).state_dict()
    base = load_hf_model(phi3.path).state_dict()
    for layer in range(2):
        for module in ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj"):
            name = f"model.layers.{layer}.{module}"
            weights = adapter.modules[name]
            delta = torch.cat([weights.delta_weight(part) for part in range(len(weights.lora_a))])
            expected = merged[f"{name}.weight"] - base[f"{name}.weight"]
            torch.testing.assert_close(delta, expected, atol=2e-6, rtol=1e-5)
    assert adapter.num_bytes == sum(tensor.numel() * 4 for tensor in raw.values())

    with pytest.raises(ValueError, match=r"'model\.layers\.\d\.\w+\.\w+_proj'.*part_sizes"):
        phi3.load(path, part_sizes=None)
    wrong = {**phi3.part_sizes, "model.layers.0.mlp.gate_up_proj": (128, 96)}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_up_proj'.*256 rows.*224"):
        phi3.load(path, part_sizes=wrong)


# ------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("targets", "module"),
    [
        (["q_proj", "embed_tokens"], "model.embed_tokens"),
        (["v_proj", "lm_head"], "lm_head"),
    ],
)
def test_modules_kvflow_cannot_adapt_are_named(
    llama: Layout, tmp_path: Path, targets: list[str], module: str
) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=targets)
    with pytest.raises(ValueError, match=rf"'{module}'"):
        llama.load(path)


def test_moe_expert_and_unknown_modules_are_named(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["q_proj"])
    tensors = _peft_tensors(path)
    expert = f"{PEFT_PREFIX}model.layers.0.mlp.experts.3.gate_proj"
    tensors[f"{expert}.lora_A.weight"] = torch.zeros(8, 64)
    tensors[f"{expert}.lora_B.weight"] = torch.zeros(128, 8)
    _rewrite(path, config={"target_modules": ["q_proj", "gate_proj"]}, tensors=tensors)
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.experts\.3\.gate_proj'.*cannot apply"
    ):
        llama.load(path)
    # A layer the model does not take an adapter on (here: not listed in lora_modules).
    path = make_peft_adapter(llama.path, tmp_path / "adapter2", target_modules=["o_proj"])
    lora_modules = {k: v for k, v in llama.lora_modules.items() if not k.endswith("o_proj")}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj'"):
        llama.load(path, lora_modules=lora_modules)


def test_rank_above_the_limit_names_rank_limit_and_module(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(
        llama.path,
        tmp_path / "adapter",
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"v_proj": 12},
    )
    assert llama.load(path, max_lora_rank=12).rank == 12
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.v_proj' has rank 12, above max_lora_rank=8",
    ):
        llama.load(path, max_lora_rank=8)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_bias": True}, "lora_bias"),
    ],
)
def test_unsupported_peft_options_are_named(
    llama: Layout, tmp_path: Path, options: dict[str, Any], named: str
) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["q_proj"], **options)
    with pytest.raises(ValueError, match=named):
        llama.load(path)


def test_config_problems_are_named(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["q_proj"], r=4)
    original = json.loads((path / "adapter_config.json").read_text())
    cases = [
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
        ({"r": 8}, r"'model\.layers\.0\.self_attn\.q_proj'.*rank 4.*rank 8"),
        ({"r": 0}, "r must be a positive integer"),
        ({"lora_alpha": "big"}, "lora_alpha must be a finite number"),
        ({"target_modules": "(unclosed"}, "not a valid regular expression"),
        ({"target_modules": ["v_proj"]}, r"'model\.layers\.0\.self_attn\.q_proj'.*target_modules"),
    ]
    for change, message in cases:
        (path / "adapter_config.json").write_text(json.dumps({**original, **change}))
        with pytest.raises(ValueError, match=message):
            llama.load(path)


def test_tensor_problems_are_named(llama: Layout, tmp_path: Path) -> None:
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["q_proj"], r=4)
    original = _peft_tensors(path)
    q_proj = f"{PEFT_PREFIX}model.layers.1.self_attn.q_proj"
    cases = [
        (
            {f"{q_proj}.lora_B.weight": original[f"{q_proj}.lora_B.weight"][:, :3].contiguous()},
            r"'model\.layers\.1\.self_attn\.q_proj'.*disagree on the rank",
        ),
        (
            {f"{q_proj}.lora_B.weight": torch.zeros(48, 4)},
            r"'model\.layers\.1\.self_attn\.q_proj'.*48 rows.*64",
        ),
        (
            {f"{q_proj}.lora_A.weight": torch.zeros(4, 80)},
            r"'model\.layers\.1\.self_attn\.qkv_proj'.*in_features \[80\].*64",
        ),
        (
            {f"{q_proj}.lora_B.bias": torch.zeros(64)},
            r"'[\w.]+\.q_proj\.lora_B\.bias' \(module 'model\.layers\.1\.self_attn\.q_proj'\)",
        ),
        ({f"{q_proj}.lora_A.weight": torch.zeros(4, 64, 1)}, r"2-D float tensor"),
        ({f"{q_proj}.lora_A.other.weight": torch.zeros(4, 64)}, "several adapters"),
    ]
    for change, message in cases:
        _rewrite(path, tensors={**original, **change})
        with pytest.raises(ValueError, match=message):
            llama.load(path)
    _rewrite(path, tensors={k: v for k, v in original.items() if k != f"{q_proj}.lora_B.weight"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_proj' has no lora_B"):
        llama.load(path)
    _rewrite(path, tensors={"unrelated": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="'unrelated'"):
        llama.load(path)


def test_adapter_for_another_base_shape_is_refused(llama: Layout, tmp_path: Path) -> None:
    other = make_tiny_llama(tmp_path / "other", intermediate_size=96)
    path = make_peft_adapter(other, tmp_path / "adapter", target_modules=["gate_proj"])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj'.*96 rows.*128"):
        llama.load(path)


def test_missing_files_are_named(llama: Layout, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llama.load(tmp_path / "nowhere")
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["q_proj"])
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"neither adapter_model\.safetensors nor adapter_model\.bin"
    ):
        llama.load(path)
    (path / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        llama.load(path)


def test_merged_adapter_changes_greedy_tokens(
    llama: Layout, llama_reference: Any, tmp_path: Path
) -> None:
    """The helper's adapters are strong enough for engine tests to tell an adapter's output from the base's."""
    from tests.lora.adapters import greedy_reference

    prompt = list(range(100, 120))
    base = greedy_reference(llama_reference, prompt, 8)
    for seed, targets in ((1, ["q_proj", "v_proj"]), (2, ["gate_proj", "down_proj"])):
        path = make_peft_adapter(
            llama.path, tmp_path / f"adapter{seed}", target_modules=targets, seed=seed
        )
        assert greedy_reference(merged_model(llama.path, path), prompt, 8) != base


def test_a_part_targeted_twice_is_refused(llama: Layout, tmp_path: Path) -> None:
    """q_proj's own adapter and a fused qkv_proj adapter of the same layer would both write part 0."""
    path = make_peft_adapter(llama.path, tmp_path / "adapter", target_modules=["q_proj"], r=4)
    fused = f"{PEFT_PREFIX}model.layers.1.self_attn.qkv_proj"
    tensors = {
        **_peft_tensors(path),
        f"{fused}.lora_A.weight": torch.zeros(4, 64),
        f"{fused}.lora_B.weight": torch.zeros(128, 4),
    }
    _rewrite(path, config={"target_modules": ["q_proj", "qkv_proj"]}, tensors=tensors)
    with pytest.raises(
        ValueError, match=r"part 0 of 'model\.layers\.1\.self_attn\.qkv_proj' twice"
    ):
        llama.load(path)
