"""``fuse_`` / ``unfuse_``: what is swapped and why, and that a fused model computes what the original
did (outputs and every gradient to fp32 tolerance without a recipe; within FP8's SQNR with one)."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8_checks import sqnr_db
from helpers_models import (
    AliasedActivation,
    Block,
    CallsInnerActivation,
    CallsInnerLinear,
    CallsNestedModuleWhole,
    CallsSequentialWhole,
    ConstantScaleMLP,
    Conv1D,
    DropoutBetween,
    FunctionalZoo,
    GatedMLP,
    LinearCalledTwice,
    LitGPTMLP,
    LoopedUntraceable,
    MLPWithAuxLoss,
    ModuleListMLP,
    ModuleListWithActivation,
    NanoGPTMLP,
    FrozenFeatureMLP,
    OptionalArgMLP,
    OptionalBranchMLP,
    OutputReused,
    ScaledResidualMLP,
    SequentialIndexed,
    SequentialItemwise,
    SequentialLooped,
    SequentialTwoWays,
    SharedActivation,
    ShuffledMLP,
    StochasticDepthMLP,
    TiedHeadLM,
    TrainingDependent,
    Untraceable,
    assert_same_outputs_and_grads,
    fused_and_reference,
    sequential_mlp,
)
from lightning_fuse import (
    DelayedScaling,
    FP8Linear,
    FuseConfig,
    FuseReport,
    FusedLinearBiasActivation,
    fp8_autocast,
    fp8_state_of,
    fuse_,
    unfuse_,
)
from lightning_fuse.chain_finder import find_chains


def _x(d: int = 16, batch: int = 2, tokens: int = 3) -> torch.Tensor:
    return torch.randn(batch, tokens, d)


# -- swapped models compute what the originals did ------------------------------------------------


@pytest.mark.parametrize("make", [
    sequential_mlp,
    lambda: sequential_mlp(activation=nn.ReLU()),
    NanoGPTMLP,
    lambda: NanoGPTMLP(bias=False),
    ShuffledMLP,
    LitGPTMLP,
    lambda: LitGPTMLP(approximate="none"),
    FunctionalZoo,
    ModuleListMLP,
], ids=["sequential", "sequential-relu", "nanogpt", "nanogpt-nobias", "shuffled", "litgpt-tanh", "litgpt-erf",
        "functional-zoo", "modulelist"])
def test_fused_model_matches_original(make):
    model, reference = fused_and_reference(make)
    report = fuse_(model)
    assert report.num_fused >= 1 and all(chain.fused for chain in report.chains)
    assert_same_outputs_and_grads(model, reference, _x())


def test_nanogpt_mlp_swaps():
    for make in (NanoGPTMLP, ShuffledMLP):
        model = make()
        fuse_(model)
        assert isinstance(model.c_fc, FusedLinearBiasActivation)  # chain: c_fc -> gelu
        assert model.c_fc.activation == "gelu"
        assert type(model.gelu) is nn.Identity  # applied inside c_fc now
        assert isinstance(model.c_proj, FP8Linear)  # convert="mlp": consumes the GELU's output
        assert type(model.dropout) is nn.Dropout  # not a linear


def test_functional_activation_is_skipped_in_the_forward_that_calls_it():
    model, reference = fused_and_reference(LitGPTMLP)
    fuse_(model)
    # The class forward runs as written; the call of F.gelu on fc's output returns it as it is.
    assert "forward" in model.__dict__ and model.forward.chains == {"fc": "F.gelu"}
    assert list(inspect.signature(model.forward).parameters) == ["x"]
    assert model(x=_x()).shape == (2, 3, 16)  # keyword calls still work
    assert_same_outputs_and_grads(model, reference, _x())


def _gpt2(activation: str):
    transformers = pytest.importorskip("transformers")

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64,
                        activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class _LogitsOf(nn.Module):
    """Feeds embeddings to a HF causal LM and returns its logits (so inputs have a gradient)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.lm(inputs_embeds=embeddings).logits


@pytest.mark.parametrize("activation, expected", [
    ("gelu_new", "gelu_tanh"), ("gelu", "gelu"), ("relu", "relu"), ("gelu_pytorch_tanh", "gelu_tanh")])
def test_gpt2(activation, expected):
    model, reference = fused_and_reference(lambda: _gpt2(activation))
    report = fuse_(model)
    for i, block in enumerate(model.transformer.h):
        # c_fc (HF Conv1D) -> act is each block's chain; c_proj alone consumes the activation.
        assert isinstance(block.mlp.c_fc, FusedLinearBiasActivation) and block.mlp.c_fc.activation == expected
        assert type(block.mlp.act) is nn.Identity
        assert isinstance(block.mlp.c_proj, FP8Linear)
        # convert="mlp" leaves attention alone
        assert type(block.attn.c_attn).__name__ == "Conv1D"
    assert [chain.name for chain in report.chains if chain.fused] == \
        ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert {linear.name for linear in report.linears} == {"transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"}
    assert_same_outputs_and_grads(_LogitsOf(model), _LogitsOf(reference), _x(32))


def test_gpt2_convert_all_never_converts_tied_head():
    model, reference = fused_and_reference(lambda: _gpt2("gelu_new"))
    report = fuse_(model, FuseConfig(convert="all"))
    linears = {linear.name: linear for linear in report.linears}
    # attention projections are eligible under "all"
    assert isinstance(model.transformer.h[0].attn.c_attn, FP8Linear) and linears["transformer.h.0.attn.c_attn"].fused
    # lm_head's weight is wte's: converting it would put the embedding in an FP8 layer's hands
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    assert not linears["lm_head"].fused and "transformer.wte.weight" in linears["lm_head"].reason
    assert_same_outputs_and_grads(_LogitsOf(model), _LogitsOf(reference), _x(32))


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "quick_gelu", "relu2", "silu"])
def test_bert_intermediate(hidden_act):
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertIntermediate

    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
                        hidden_act=hidden_act)
    model, reference = fused_and_reference(lambda: BertIntermediate(config))
    report = fuse_(model)
    assert isinstance(model.dense, FusedLinearBiasActivation)
    assert type(model.intermediate_act_fn) is nn.Identity
    # BERT's output linear lives in BertOutput, called by BertLayer: not in this forward
    assert report.linears == ()
    assert_same_outputs_and_grads(model, reference, _x(32))


# -- near misses: left alone and reported ---------------------------------------------------------


@pytest.mark.parametrize("make, linears, why", [
    # Dropout between: the activation sees the dropped-out value, not the linear's output
    (DropoutBetween, ["fc"], "Dropout"),
    # act(h) + h: h itself is needed, so the activation cannot be folded into the linear
    (OutputReused, ["fc"], "2 users"),
    # one ReLU instance after two linears: replacing it would remove it after both
    (SharedActivation, ["fc1", "fc2"], "called at 2 places"),
    # a linear called twice would apply its fused activation after both calls
    (LinearCalledTwice, ["fc"], "called 2 times"),
    # forward reads self.training: the graph traced in one mode is not the other's
    (TrainingDependent, ["fc"], "train and eval"),
    # called without its optional argument, the forward also reads the linear's output before the activation
    (OptionalBranchMLP, ["fc"], "called with skip=None, its parent's forward takes another path"),
    # a Sequential its parent indexes: registration order is not execution order, the parent's graph
    # decides (here the first linear's output is used twice)
    (SequentialIndexed, ["net.0"], "its output has 2 users"),
    # a Sequential called whole and item by item: its linear's output goes to more places
    (SequentialTwoWays, ["net.0"], "called both as a whole and item by item"),
])
def test_near_misses_are_left_alone(make, linears, why):
    model, reference = fused_and_reference(make)
    with pytest.warns(UserWarning, match="no fusable"):
        report = fuse_(model)
    chains = {chain.name: chain for chain in report.chains}
    for name in linears:
        assert not chains[name].fused and why in chains[name].reason
        assert type(model.get_submodule(name)) is nn.Linear
    assert "forward" not in model.__dict__
    assert_same_outputs_and_grads(model, reference, _x())


def test_activation_not_in_config():
    model = sequential_mlp(activation=nn.ReLU())
    with pytest.warns(UserWarning, match="no fusable"):
        report = fuse_(model, FuseConfig(activations=("gelu", "gelu_tanh")))
    assert "'relu' is not in FuseConfig.activations" in report.chains[0].reason
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.ReLU


def test_untraceable_module_is_reported():
    model = nn.Sequential(Untraceable(), NanoGPTMLP())
    report = fuse_(model)
    assert [s.name for s in report.skipped] == ["0"]
    assert type(model[0].fc) is nn.Linear  # left as it is
    assert isinstance(model[1].c_fc, FusedLinearBiasActivation)
    assert "not traced" in str(report)


def test_no_chains_warns_and_leaves_the_model_unchanged():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="no fusable Linear -> activation chain in Sequential"):
        report = fuse_(model)
    assert report.chains == () and report.linears == ()
    assert [type(m) for m in model] == [nn.Linear, nn.Tanh, nn.Linear]
    assert fp8_state_of(model) is None and "_lightning_fuse" not in model.__dict__
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- convert modes, filters, exclusions -----------------------------------------------------------


@pytest.mark.parametrize("convert, expected", [
    # only the chain's linear
    ("chains", {"attn_proj": nn.Linear, "mlp.c_fc": FusedLinearBiasActivation, "mlp.c_proj": nn.Linear}),
    # also the MLP's output linear (the GELU's sole consumer)
    ("mlp", {"attn_proj": nn.Linear, "mlp.c_fc": FusedLinearBiasActivation, "mlp.c_proj": FP8Linear}),
    # every eligible linear
    ("all", {"attn_proj": FP8Linear, "mlp.c_fc": FusedLinearBiasActivation, "mlp.c_proj": FP8Linear}),
])
def test_convert_modes(convert, expected):
    model, reference = fused_and_reference(Block)
    report = fuse_(model, FuseConfig(convert=convert))
    assert {name: type(model.get_submodule(name)) for name in expected} == expected
    roles = {linear.name: linear.role for linear in report.linears}
    assert roles == {"chains": {}, "mlp": {"mlp.c_proj": "mlp"},
                     "all": {"attn_proj": "other", "mlp.c_proj": "mlp"}}[convert]
    assert_same_outputs_and_grads(model, reference, _x())


def test_module_filter_fn():
    seen = []

    def keep(module: nn.Module, fqn: str) -> bool:
        seen.append((type(module), fqn))
        return fqn != "0.mlp.c_proj"

    model = nn.Sequential(Block(), Block())
    report = fuse_(model, FuseConfig(convert="all"), module_filter_fn=keep)
    assert (nn.Linear, "0.mlp.c_proj") in seen and all(t is nn.Linear for t, _ in seen)
    # rejected by the filter: stays nn.Linear, and says so
    assert type(model[0].mlp.c_proj) is nn.Linear
    assert {l.name: l.reason for l in report.linears}["0.mlp.c_proj"] == "module_filter_fn returned False"
    # the filter rejects nothing else
    assert isinstance(model[1].mlp.c_proj, FP8Linear) and isinstance(model[0].attn_proj, FP8Linear)


def test_filter_on_a_chain_linear():
    model = NanoGPTMLP()
    with pytest.warns(UserWarning, match="no fusable"):
        report = fuse_(model, module_filter_fn=lambda module, fqn: fqn != "c_fc")
    assert report.chains[0].reason == "module_filter_fn returned False"
    # not fused, so neither the GELU nor c_proj (the MLP is not fused) change
    assert [type(m) for m in model.children()] == [nn.Linear, nn.GELU, nn.Linear, nn.Dropout]


def test_exclude_patterns():
    model = nn.Sequential(Block(), Block())
    report = fuse_(model, FuseConfig(convert="all", exclude=("*.attn_proj", "1.mlp.*")))
    assert type(model[0].attn_proj) is nn.Linear and type(model[1].attn_proj) is nn.Linear
    assert type(model[1].mlp.c_fc) is nn.Linear and isinstance(model[0].mlp.c_fc, FusedLinearBiasActivation)
    assert "'1.mlp.*'" in {c.name: c.reason for c in report.chains}["1.mlp.c_fc"]


def test_linear_subclass_with_own_forward_is_not_swapped():
    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(ScaledLinear(8, 8), nn.GELU())
    with pytest.warns(UserWarning, match="no fusable"):
        report = fuse_(model)
    assert "overrides nn.Linear.forward" in report.chains[0].reason and type(model[0]) is ScaledLinear


def test_tied_weights_in_chain_mode_all():
    model = TiedHeadLM()
    report = fuse_(model, FuseConfig(convert="all"))
    assert type(model.lm_head) is nn.Linear
    assert "wte.weight" in {l.name: l.reason for l in report.linears}["lm_head"]


# -- state, identity, round trips -----------------------------------------------------------------


def test_state_dict_round_trip_both_ways():
    fused, plain = fused_and_reference(lambda: nn.Sequential(Block(), LitGPTMLP()))
    keys = list(plain.state_dict())
    fuse_(fused, FuseConfig(convert="all"))
    assert list(fused.state_dict()) == keys
    # fused -> plain
    other = copy.deepcopy(plain)
    for p in other.parameters():
        p.data.add_(1.0)
    other.load_state_dict(fused.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), plain.state_dict().values()))
    # plain -> fused
    for p in plain.parameters():
        p.data.mul_(0.5)
    fused.load_state_dict(plain.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fused.state_dict().values(), plain.state_dict().values()))


def test_same_parameter_objects_and_unfuse():
    model = nn.Sequential(Block(), LitGPTMLP(), sequential_mlp())
    params = dict(model.named_parameters())
    types = {name: type(m) for name, m in model.named_modules()}
    fuse_(model, FuseConfig(convert="all"))
    assert all(p is params[n] for n, p in model.named_parameters())
    # training continues on the fused model; unfuse_ must keep the updated parameters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    x = _x()
    expected = model(x)
    assert unfuse_(model) is model
    assert {name: type(m) for name, m in model.named_modules()} == types
    assert all(p is params[n] for n, p in model.named_parameters())
    assert "forward" not in model[1].__dict__ and fp8_state_of(model) is None
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)


def test_fuse_unfuse_fuse():
    model = LitGPTMLP()
    fuse_(model)
    unfuse_(model)
    report = fuse_(model)
    assert report.num_fused == 1 and isinstance(model.fc, FusedLinearBiasActivation)


def test_fusing_after_a_partial_unfuse():
    model = nn.Sequential(Block(), Block())
    fuse_(model)
    unfuse_(model[1])  # works on a part: that part is plain again
    assert type(model[1].mlp.c_fc) is nn.Linear and type(model[1].mlp.gelu) is nn.GELU
    assert isinstance(model[0].mlp.c_fc, FusedLinearBiasActivation)
    with pytest.raises(ValueError, match="partly unfused"):
        fuse_(model)
    unfuse_(model)
    assert fuse_(model).num_fused == 2


def test_fusing_twice():
    model = nn.Sequential(Block(), Block())
    report = fuse_(model)
    modules = list(model.modules())
    # the same config: a no-op returning the first report
    assert fuse_(model, FuseConfig()) is report
    assert list(model.modules()) == modules
    # another config: an error rather than a silent mix of the two
    with pytest.raises(ValueError, match="already fused .* unfuse_"):
        fuse_(model, FuseConfig(convert="all"))
    # a part of a fused model
    with pytest.raises(ValueError, match="already fused"):
        fuse_(model[0])


def test_fp8_state_registers_every_swapped_module_in_order():
    model = nn.Sequential(ShuffledMLP(), Block())
    fuse_(model, FuseConfig(convert="all"))
    state = fp8_state_of(model)
    expected = [name for name, m in model.named_modules() if isinstance(m, (FP8Linear, FusedLinearBiasActivation))]
    assert state.names == expected == ["0.c_proj", "0.c_fc", "1.attn_proj", "1.mlp.c_fc", "1.mlp.c_proj"]
    assert all(model.get_submodule(n).fp8_state is state for n in expected)
    # under a wrapper, the one fused part's state is found
    assert fp8_state_of(nn.Sequential(model)) is state


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_copy_and_pickle_of_a_fused_model(copier):
    model = nn.Sequential(LitGPTMLP(), NanoGPTMLP())
    fuse_(model)
    clone = copier(model)
    x = _x()
    torch.testing.assert_close(clone(x), model(x))
    # the clone's regenerated forward runs the clone's modules, not the original's
    assert clone[0].forward.owner is clone[0]
    with torch.no_grad():
        clone[0].fc.weight.zero_()
    assert not torch.allclose(clone(x), model(x))
    state = fp8_state_of(clone)
    assert state is not fp8_state_of(model) and clone[0].fc.fp8_state is state
    unfuse_(clone)
    assert type(clone[0].fc) is nn.Linear and type(clone[1].gelu) is nn.GELU and "forward" not in clone[0].__dict__


def test_report_rendering():
    model = nn.Sequential(Block(), DropoutBetween())
    report = fuse_(model, FuseConfig(convert="all"))
    assert isinstance(report, FuseReport)
    text = str(report)
    assert text == report.table()
    assert "0.mlp.c_fc" in text and "FusedLinearBiasActivation" in text and "Dropout (`drop`)" in text
    assert "1 of 2 chains fused" in text
    header = text.splitlines()[0].split()
    assert header[:8] == ["name", "kind", "in", "out", "activation", "swapped", "to", "fp8"] and "shape" in header
    as_dict = report.to_dict()
    assert as_dict["config"]["convert"] == "all"
    assert {c["name"]: c["fused"] for c in as_dict["chains"]} == {"0.mlp.c_fc": True, "1.fc": False}
    assert as_dict["chains"][0]["fp8"] is True and as_dict["chains"][0]["fp8_reason"] == ""


def test_the_report_says_why_a_fused_chain_has_no_mlp_consumer():
    # convert="mlp" converts only a linear that alone takes the chain's output in the same forward:
    # the report names the chains it found none for, and why, and the consumer of the others.
    def model():
        return nn.Sequential(Block(), nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32)))

    report = fuse_(model(), FuseConfig(convert="mlp"))
    chains = {chain.name: chain for chain in report.chains}
    assert (chains["0.mlp.c_fc"].consumer, chains["0.mlp.c_fc"].no_consumer) == ("0.mlp.c_proj", "")
    assert (chains["1.0"].consumer, chains["1.0"].no_consumer) == ("", "the activation's output goes to `2` (LayerNorm)")
    lines = str(report).splitlines()
    at = lines.index("fused chains whose output no linear takes alone (convert='mlp' converts only such a linear; "
                     "convert='all' converts the others too):")
    assert lines[at + 1] == "  1.0: the activation's output goes to `2` (LayerNorm)"
    assert "0.mlp.c_fc:" not in "\n".join(lines[at:])
    # Not said where the mode converts no consumer anyway, or every other linear too.
    for convert in ("chains", "all"):
        assert "no linear takes alone" not in str(fuse_(model(), FuseConfig(convert=convert)))


def test_fp8_shape_reason_is_reported():
    model = nn.Sequential(nn.Linear(12, 40), nn.GELU())
    report = fuse_(model)
    chain = report.chains[0]
    assert chain.fused and not chain.fp8 and "in_features=12" in chain.fp8_reason


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        fuse_(lambda x: x)
    with pytest.raises(ValueError, match="`module_filter_fn` must be an import path with a module and a name"):
        fuse_(NanoGPTMLP(), module_filter_fn="c_fc")
    with pytest.raises(TypeError, match="`module_filter_fn` must be a callable"):
        fuse_(NanoGPTMLP(), module_filter_fn=3)
    with pytest.raises(ValueError, match="valid keys"):
        fuse_(NanoGPTMLP(), {"conver": "all"})


# -- FP8, emulated on CPU ------------------------------------------------------------------------


def test_emulated_fp8_smoke():
    torch.manual_seed(0)
    model = NanoGPTMLP(d=32)  # 32 -> 128 -> 32: multiples of 16, as torch._scaled_mm needs
    reference = copy.deepcopy(model).double()
    report = fuse_(model, FuseConfig(emulate=True))
    assert all(chain.fp8 for chain in report.chains) and all(linear.fp8 for linear in report.linears)
    x, upstream = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    for _ in range(2):  # the first step records amaxes; the second runs with calibrated scales
        model.zero_grad()
        x_fused = x.clone().requires_grad_()
        with fp8_autocast(DelayedScaling()):
            out = model(x_fused)
        (out * upstream).sum().backward()
    stats = fp8_state_of(model).stats()
    # the FP8 path ran (scales moved off their initial 1.0) and saw no inf/nan
    assert stats["scale_min"] != 1.0 and stats["nonfinite_amax"] == 0
    x_ref = x.double().requires_grad_()
    out_ref = reference(x_ref)
    (out_ref * upstream.double()).sum().backward()
    assert sqnr_db(out.detach(), out_ref.detach()) >= 20
    assert sqnr_db(x_fused.grad, x_ref.grad) >= 20
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert sqnr_db(param.grad, ref.grad) >= 20, name


def test_a_sequential_its_parent_iterates_with_a_residual_is_not_read_in_item_order():
    # Registration order is not execution order: the parent's graph has no chain, so nothing is fused.
    model, reference = fused_and_reference(SequentialLooped)
    with pytest.warns(UserWarning, match="no fusable Linear -> activation chain"):
        report = fuse_(model)
    assert report.chains == () and type(model.layers[0]) is nn.Linear
    assert_same_outputs_and_grads(model, reference, _x())


def test_a_sequential_its_parent_calls_item_by_item_in_order_is_fused():
    model, reference = fused_and_reference(SequentialItemwise)
    report = fuse_(model)
    assert [(c.name, c.activation, c.fused) for c in report.chains] == [("net.0", "gelu_tanh", True)]
    assert isinstance(model.net[0], FusedLinearBiasActivation) and isinstance(model.net[2], FP8Linear)
    assert_same_outputs_and_grads(model, reference, _x())


@pytest.mark.parametrize("make", [GatedMLP, OptionalArgMLP])
def test_a_functional_chain_in_a_forward_of_several_arguments_is_fused_for_every_call_pattern(make):
    # The chain is the same with the second argument a tensor, None or its default: fused, and the
    # forward's own code (its `is None` branches included) runs on every call.
    model, reference = fused_and_reference(make)
    report = fuse_(model)
    chain = next(c for c in report.chains if c.name == "fc")
    assert chain.fused, chain.reason
    if make is OptionalArgMLP:
        x = _x()
        torch.testing.assert_close(model(x), reference(x))
        torch.testing.assert_close(model(x, 0.5), reference(x, 0.5))
        return
    x = _x()
    torch.testing.assert_close(model(x, None), reference(x, None))
    gate = torch.rand(64)
    torch.testing.assert_close(model(x, gate), reference(x, gate))


def test_unfuse_of_a_module_holding_a_fused_model_clears_its_record():
    mlp = sequential_mlp()
    fuse_(mlp)
    wrapper = nn.ModuleDict({"model": mlp})
    unfuse_(wrapper)
    assert type(mlp[0]) is nn.Linear
    assert fp8_state_of(mlp) is None and fp8_state_of(wrapper) is None
    assert fuse_(mlp).num_fused == 1  # not refused as "partly unfused"


def test_a_model_that_is_itself_a_linear_is_left_alone_with_the_reason():
    model = nn.Linear(16, 16)
    with pytest.warns(UserWarning, match="the model is unchanged"):
        report = fuse_(model, FuseConfig(convert="all"))
    (entry,) = report.linears
    assert not entry.fused and "it is the model itself" in entry.reason
    assert type(model) is nn.Linear and "" not in model.__dict__
    assert fuse_(nn.Sequential(model), FuseConfig(convert="all")).linears[0].fused  # wrapped, it is swapped


class _AttentionThenMLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = sequential_mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attn(x, x, x)
        return self.mlp(attended)


def test_multihead_attentions_out_proj_is_not_reported_as_converted():
    # nn.MultiheadAttention reads out_proj.weight itself: a swapped out_proj would never run.
    model, reference = fused_and_reference(_AttentionThenMLP)
    report = fuse_(model, FuseConfig(convert="all"))
    entries = {entry.name: entry for entry in report.linears}
    assert not entries["attn.out_proj"].fused and "never calls it" in entries["attn.out_proj"].reason
    assert type(model.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(model.mlp[0], FusedLinearBiasActivation)
    assert_same_outputs_and_grads(model, reference, _x())


# -- what one trace does not show ---------------------------------------------------------------------


@pytest.mark.parametrize("wrap_instance_forward", [False, True], ids=["untraceable", "instance forward"])
def test_a_sequential_iterated_by_a_parent_that_cannot_be_read_is_left_alone(wrap_instance_forward):
    model, reference = fused_and_reference(LoopedUntraceable)
    if wrap_instance_forward:  # a traceable parent whose forward a hook wrapped on the instance
        original = model.forward
        model.forward = lambda *args, **kwargs: original(*args, **kwargs)
    with pytest.warns(UserWarning, match="no fusable"):
        report = fuse_(model)
    (chain,) = report.chains
    assert not chain.fused and "order its items run in is unknown" in chain.reason
    assert_same_outputs_and_grads(model, reference, _x())


def test_a_sequential_called_whole_by_a_parent_that_cannot_be_traced_is_fused():
    model, reference = fused_and_reference(CallsSequentialWhole)
    report = fuse_(model)
    assert [(c.name, c.fused) for c in report.chains] == [("mlp.0", True)]
    assert report.skipped and report.skipped[0].name == "CallsSequentialWhole"
    assert_same_outputs_and_grads(model, reference, _x())


def test_a_functional_chain_under_no_grad_gets_no_gradient():
    model, reference = fused_and_reference(FrozenFeatureMLP)
    assert fuse_(model).num_fused == 1
    x = _x()
    torch.testing.assert_close(model(x), reference(x))
    model(x).sum().backward()
    assert model.fc.weight.grad is None and model.head.weight.grad is not None


def test_a_functional_chain_under_autocast_disabled_runs_in_float32():
    class AutocastOff(FrozenFeatureMLP):
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                h = F.relu(self.fc(x.float()))
            return self.head(h)

    model, reference = fused_and_reference(AutocastOff)
    assert fuse_(model).num_fused == 1
    dtypes = {}
    for module, tag in ((model.fc, "fused"), (reference.fc, "reference")):
        module.register_forward_hook(lambda m, args, out, tag=tag: dtypes.__setitem__(tag, out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(_x()), reference(_x())
    assert dtypes == {"fused": torch.float32, "reference": torch.float32}


def test_a_forward_that_stores_on_self_and_reads_attributes_runs_as_written():
    model, reference = fused_and_reference(MLPWithAuxLoss)
    assert fuse_(model).num_fused == 1
    assert "aux_loss" not in model.__dict__  # finding the chains left nothing behind
    x = _x()
    model(x), reference(x)
    torch.testing.assert_close(model.aux_loss, reference.aux_loss)

    model, reference = fused_and_reference(ScaledResidualMLP)
    assert fuse_(model).num_fused == 1
    model.alpha = reference.alpha = 1.0  # a schedule moves on after fuse_
    assert_same_outputs_and_grads(model, reference, _x())


def test_a_random_branch_in_the_forward_is_drawn_at_every_call():
    torch.manual_seed(0)
    model = StochasticDepthMLP()
    fuse_(model)
    model.train()
    x = _x()
    skipped = sum(torch.equal(model(x), x) for _ in range(200))
    assert 60 < skipped < 140  # p = 0.5


def test_a_fused_linear_whose_output_skips_its_activation_at_run_time_raises():
    class SometimesRaw(LitGPTMLP):
        raw = False

        def forward(self, x):
            h = self.fc(x)
            if self.raw:  # a Python flag: the trace saw one branch only
                return self.proj(h)
            return self.proj(F.gelu(h, approximate=self.approximate))

    model = SometimesRaw()
    assert fuse_(model).num_fused == 1
    model(_x())
    model.raw = True
    with pytest.raises(RuntimeError, match="the output of `fc` did not go to the activation"):
        model(_x())


def test_an_activation_module_registered_twice_is_left_alone():
    model, reference = fused_and_reference(AliasedActivation)
    with pytest.warns(UserWarning, match="no fusable"):
        report = fuse_(model)
    (chain,) = report.chains
    assert not chain.fused and "registered at 2 places" in chain.reason
    assert_same_outputs_and_grads(model, reference, _x())


def test_finding_chains_leaves_no_attribute_and_tensor_constants_do_not_refuse_a_chain():
    model = ConstantScaleMLP()
    before = dict(model.__dict__)
    search = find_chains(model)
    assert set(model.__dict__) == set(before)
    (chain,) = search.chains
    assert chain.reason == ""


@pytest.mark.parametrize("make", [ModuleListMLP, ModuleListWithActivation])
def test_a_partial_unfuse_that_would_split_a_chain_is_refused(make):
    model, reference = fused_and_reference(make)
    assert fuse_(model).num_fused == 1
    with pytest.raises(ValueError, match="other half|stands for an activation"):
        unfuse_(model.layers)
    if make is ModuleListWithActivation:
        with pytest.raises(ValueError, match="stands for an activation fused into a linear outside"):
            unfuse_(model.act)
    assert_same_outputs_and_grads(model, reference, _x())  # nothing changed
    unfuse_(model)
    assert type(model.layers[0]) is nn.Linear and "forward" not in model.__dict__


def test_unfuse_puts_modules_back_in_the_current_train_or_eval_mode():
    model = sequential_mlp().train()
    fuse_(model)
    model.eval()
    unfuse_(model)
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("make", [LitGPTMLP, FrozenFeatureMLP, sequential_mlp])
def test_a_fused_model_compiles_without_a_graph_break(make, monkeypatch):
    # dynamo traces through the skipped activation call (its TorchFunctionMode) and the modules' own paths
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: a triton_op cannot compile on CPU
    model, reference = fused_and_reference(make)
    fuse_(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = _x().requires_grad_()
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, reference(x))


def test_a_chain_whose_linear_or_activation_another_forward_calls_directly_is_left_alone():
    for make in (CallsInnerLinear, CallsInnerActivation):
        model, reference = fused_and_reference(make)
        with pytest.warns(UserWarning, match="no fusable"):
            report = fuse_(model)
        assert not report.chains[0].fused and "also called directly" in report.chains[0].reason
        assert type(model.inner.fc) is nn.Linear and type(model.inner.act) is nn.GELU
        assert_same_outputs_and_grads(model, reference, _x())
    model, reference = fused_and_reference(CallsNestedModuleWhole)
    assert fuse_(model).num_fused == 1 and isinstance(model.wrap.inner.fc, FusedLinearBiasActivation)
    assert_same_outputs_and_grads(model, reference, _x())


def test_a_functional_activation_called_with_other_arguments_than_traced_raises():
    # fc was fused with F.gelu's tanh approximation, read from self.approximate when traced: a call with
    # another approximation must not silently get the traced one.
    model, reference = fused_and_reference(LitGPTMLP)
    assert fuse_(model).num_fused == 1 and model.fc.activation == "gelu_tanh"
    x = _x()
    torch.testing.assert_close(model(x), reference(x))
    model.approximate = "none"
    with pytest.raises(RuntimeError, match=r"`fc` was fused with gelu_tanh, but F.gelu is called on its output with "
                                           r"approximate='none' \(gelu\)"):
        model(x)
    model.approximate = "tanh"  # back to what was traced
    torch.testing.assert_close(model(x), reference(x))


class _KeywordCalls(nn.Module):
    """Calls its linears with their input by keyword: ``input=`` as nn.Linear.forward names it, ``x=`` as
    HF's Conv1D.forward does."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.conv = Conv1D(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x=self.proj(input=F.gelu(self.fc(input=x))))


def test_swapped_linears_take_their_input_by_keyword_as_the_originals_did():
    model, reference = fused_and_reference(_KeywordCalls)
    report = fuse_(model, FuseConfig(convert="all"))
    assert report.num_fused == 1 and report.num_fp8_linears == 2
    assert isinstance(model.fc, FusedLinearBiasActivation) and isinstance(model.conv, FP8Linear)
    assert_same_outputs_and_grads(model, reference, _x())
    with pytest.raises(TypeError):
        model.fc(_x(), _x())  # still one input


def test_module_filter_fn_may_be_an_import_path():
    # as the callback takes it from a config file
    model = NanoGPTMLP()
    report = fuse_(model, FuseConfig(convert="mlp"), module_filter_fn="helpers_models:keep_all_but_c_proj")
    assert type(model.c_fc) is FusedLinearBiasActivation and type(model.c_proj) is nn.Linear
    assert report.linears[0].reason == "module_filter_fn returned False"


def test_a_linear_fp8_cannot_run_is_not_converted():
    # Llama's lm_head with a vocabulary of 100, say: an FP8Linear of that shape could only ever run the
    # linear's own computation, so convert="all" leaves it as it is and says why.
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 100))
    report = fuse_(model, FuseConfig(convert="all"))
    linears = {linear.name: linear for linear in report.linears}
    assert linears["2"].fused and type(model[2]) is FP8Linear
    assert not linears["3"].fused and type(model[3]) is nn.Linear
    assert linears["3"].reason == ("out_features=100 not a multiple of 16, which torch._scaled_mm requires, "
                                   "so it could never run FP8")
