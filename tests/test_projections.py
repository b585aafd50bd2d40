"""Sibling projections as one GEMM in the compiled step (pnmix/projections.py): the graph pass
that merges repeated linear calls, the fused weights behind the model's own parameters, and the
compiled step's GEMM count and tokens against the eager step's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import register_backend

from pnmix.projections import fuse_siblings, merge_repeated_linears, swapped
from pnmix.static import StaticGenerator

# aten weight products (mm, addmm: what a linear layer lowers to) per compiled forward graph, appended
# by the backend below; batched products are not counted (transformers 5.17's rotary embedding is one).
GEMMS: list[int] = []


def _count_gemms(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    GEMMS.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"
                     and str(n.target).split(".")[1] in ("mm", "addmm")))
    return gm


register_backend(name="pnmix_test_count_gemms")(aot_autograd(fw_compiler=_count_gemms))


def test_repeated_linears_merge_unless_written_between():
    def f(x, w, b):
        a = F.linear(x, w, b)
        c = F.linear(x, w, b) * 2  # repeated: merged into a
        d = F.linear(x, w)  # another call (no bias): kept
        x.add_(1)
        e = F.linear(x, w, b)  # after an in-place write of x: kept
        x += 1
        g = F.linear(x, w, b)  # after an in-place operator: kept
        return a + c + d + e + g

    gm = torch.fx.symbolic_trace(f)
    merge_repeated_linears(gm)
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.linear, torch._C._nn.linear)]
    assert len(linears) == 4
    x, w, b = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
    assert torch.equal(gm(x.clone(), w, b), f(x.clone(), w, b))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_fused_weights_back_the_parameters_with_the_same_values(family):
    model = tiny_model(family)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(1, 128, (2, 12))
    logits = model(ids).logits
    swaps = fuse_siblings(model.model)
    assert fuse_siblings(model.model) is swaps  # once per decoder
    assert len(swaps) == 5 * len(model.model.layers)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.data_ptr() == q.data_ptr() + q.nbytes and v.data_ptr() == k.data_ptr() + k.nbytes
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr() + mlp.gate_proj.weight.nbytes
    assert torch.equal(model(ids).logits, logits)  # eagerly the model is the same model
    x = torch.randn(3, 1, model.config.hidden_size)
    want = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    with swapped(swaps):
        assert type(attn.q_proj) is not torch.nn.Linear
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert type(attn.q_proj) is torch.nn.Linear  # the model's own module back
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: q/k norms between the siblings
def test_compiled_step_runs_one_gemm_per_sibling_group(family):
    import torch._dynamo

    model = tiny_model(family)
    ids, mask = torch.randint(1, 128, (2, 20)), torch.ones((2, 20), dtype=torch.long)
    eager = StaticGenerator(model, "fp16", max_len=64, compile=False).generate(ids, mask, 16)
    torch._dynamo.reset()
    GEMMS.clear()
    compiled = StaticGenerator(model, "fp16", max_len=64, compile="pnmix_test_count_gemms").generate(ids, mask, 16)
    assert torch.equal(compiled, eager)
    # per layer q/k/v, o, gate/up, down; then the LM head (7 per layer and 1 unfused)
    assert GEMMS and set(GEMMS) == {4 * len(model.model.layers) + 1}
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.parametrize("loaded_in_inference", [True, False])
def test_fusion_follows_the_parameters_inference_mode(loaded_in_inference):
    # a model loaded under inference mode has inference-tensor parameters: the fused tensors must
    # be too, or the next forward fails
    with torch.inference_mode(loaded_in_inference):
        model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
    with torch.inference_mode():
        fuse_siblings(model.model)
        assert torch.equal(model(ids).logits, want)


def test_a_fused_model_saves_and_reloads_unchanged(tmp_path):
    # the fused parameters share storage without overlapping: save_pretrained keeps every tensor
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
    fuse_siblings(model.model)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, want)
