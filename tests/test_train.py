"""The training loops: data order, exact resume, non-finite losses, the fast-path options on CPU.

Tiny settings: ``small_cnn`` on 12x12 random images, 5 fine-tuning steps per epoch.
"""
import dataclasses
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mcd_helpers.training.loop as train
from signal_on_call import signal_on_call
from mcd_helpers.training.checkpoint import RollingCheckpoint
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.data.sets import transductive_split
from mcd_helpers.models import TwoHeadNet, small_cnn
from mcd_helpers.errors import CheckpointMismatchError, NonFiniteLossError, TrainingInterrupted
from mcd_helpers.steps import step_a_loss
from mcd_helpers.training.engine import compile_model
from mcd_helpers.training.loop import finetune, pretrain


def _cfg(**overrides) -> MCDConfig:
    base = dict(seed=0, finetune_epochs=2, steps_per_epoch=5, batch_size_sup=8, batch_size_unsup=8,
                finetune_lr=0.01, eval_batch_size=64, checkpoint_every=3, pretrain_epochs=2,
                pretrain_batch_size=16, pretrain_milestones=(1,), pretrain_lr=0.05)
    return MCDConfig(**{**base, **overrides})


def _data(hw: int = 12):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, hw, hw, generator=g), torch.randint(10, (64,), generator=g)
    id_x, id_y = torch.randn(60, 1, hw, hw, generator=g), torch.randint(10, (60,), generator=g)
    ood_x = 3 + 2 * torch.rand(60, 1, hw, hw, generator=g)
    return x, y, transductive_split(id_x, id_y, ood_x, n_val=20, seed=3)  # 80 unlabeled images


def _model(seed: int = 0, **kw) -> TwoHeadNet:
    torch.manual_seed(seed)
    return small_cnn(1, 10, width=8, **kw)


def _signal_on_call(monkeypatch, name: str, k: int, sig=signal.SIGTERM) -> None:
    """Make the k-th call of ``mcd_helpers.training.loop.<name>`` send ``sig`` to this process first."""
    signal_on_call(train, name, k, sig, setattr_=monkeypatch.setattr)


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---- Step A ----

def test_step_a_sends_only_ce_of_f1_into_g():
    model, (x, y, _) = _model(), _data()
    step_a_loss(model, x[:8], y[:8]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model.F1(model.features(x[:8])), y[:8]).backward()  # by hand: CE(F1) alone
    for n, p in model.named_parameters():
        if n.startswith("G."):
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)
    assert grads["F2.weight"].abs().sum() > 0


# ---- reproducibility and exact resume ----

def test_pretraining_twice_with_one_seed_gives_identical_weights():
    x, y, _ = _data()
    a, b = _model(), _model()
    la, lb = pretrain(a, x, y, _cfg(), progress=False), pretrain(b, x, y, _cfg(), progress=False)
    assert la == lb
    _assert_same_state(a, b)


def test_pretraining_resumed_after_sigterm_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    x, y, _ = _data()
    cfg = _cfg(checkpoint_every=3)
    full = _model()
    losses = pretrain(full, x, y, cfg, progress=False, checkpoint=RollingCheckpoint(tmp_path / "a"))
    ckpt = RollingCheckpoint(tmp_path / "b")
    _signal_on_call(monkeypatch, "supervised_loss", 6)  # 4 steps per epoch: epoch 2, step 2
    with pytest.raises(TrainingInterrupted, match="SIGTERM in pre-training 2/2 step 2/4"):
        pretrain(_model(), x, y, cfg, progress=False, checkpoint=ckpt)
    monkeypatch.undo()
    assert (ckpt.load()["epoch"], ckpt.load()["step"]) == (1, 2)
    resumed = _model(seed=99)  # other initial weights: everything must come from the checkpoint
    assert pretrain(resumed, x, y, cfg, progress=False, checkpoint=ckpt, resume=True) == losses
    _assert_same_state(resumed, full)


def test_finetuning_resumed_after_sigterm_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    # Dropout makes the result depend on the torch RNG state, which the checkpoint must restore.
    x, y, split = _data()
    cfg = _cfg()
    full = _model(dropout=0.3)
    torch.manual_seed(7)
    hist = finetune(full, x, y, split, cfg, "separate", progress=False)
    ckpt = RollingCheckpoint(tmp_path / "stage")
    _signal_on_call(monkeypatch, "step_b_loss", 7)  # epoch 2, step 2: after one model selection
    cut = _model(dropout=0.3)
    torch.manual_seed(7)
    with pytest.raises(TrainingInterrupted):
        finetune(cut, x, y, split, cfg, "separate", progress=False, checkpoint=ckpt)
    monkeypatch.undo()
    state = ckpt.load()
    assert (state["epoch"], state["step"], len(state["history"]["ce"])) == (1, 2, 7)
    assert state["best_model"] is not None and len(state["history"]["val_auroc"]) == 1
    torch.manual_seed(12345)  # a different RNG state: the checkpoint's must be used
    resumed = _model(seed=99, dropout=0.3)
    got = finetune(resumed, x, y, split, cfg, "separate", progress=False, checkpoint=ckpt, resume=True)
    assert got == hist  # every per-step loss, the validation AUROCs and the best epoch
    _assert_same_state(resumed, full)


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path):
    from mcd_helpers.experiments.cache import cache_key

    x, y, split = _data()
    ckpt = RollingCheckpoint(tmp_path / "stage")
    cfg = _cfg(finetune_epochs=1, steps_per_epoch=2)
    finetune(_model(), x, y, split, cfg, "concat", progress=False, checkpoint=ckpt,
             key=cache_key(cfg, "finetune", strategy="concat"))
    other = _cfg(finetune_epochs=1, steps_per_epoch=2, finetune_lr=0.1)
    assert cache_key(other, "finetune", strategy="concat") != cache_key(cfg, "finetune", strategy="concat")
    with pytest.raises(CheckpointMismatchError, match="settings changed"):
        finetune(_model(), x, y, split, other, "concat", progress=False, checkpoint=ckpt, resume=True,
                 key=cache_key(other, "finetune", strategy="concat"))
    with pytest.raises(CheckpointMismatchError, match="fine-tuning \\(concat\\)"):  # same settings, other strategy
        finetune(_model(), x, y, split, cfg, "separate", progress=False, checkpoint=ckpt, resume=True,
                 key=cache_key(cfg, "finetune", strategy="separate"))


# ---- non-finite losses ----

class _NaNAfter(nn.Module):
    """Flatten -> Linear; from the (k+1)-th call on, the output is NaN."""

    def __init__(self, k: int, hw: int = 12):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(hw * hw, 16))
        self.k, self.calls = k, 0

    def forward(self, x):
        self.calls += 1
        out = self.body(x)
        return out * float("nan") if self.calls > self.k else out


def test_non_finite_loss_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    x, y, split = _data()
    torch.manual_seed(0)
    # Step B only, concat: one call of G per step, plus 2 for the validation after epoch 1; so
    # calls 1-5 are epoch 1, 6-7 its validation, and call 10 (NaN) is epoch 2's step 3.
    model = TwoHeadNet(_NaNAfter(k=9), 16, 10, 1)
    ckpt = RollingCheckpoint(tmp_path / "stage")
    cfg = _cfg(schedule="step_b", checkpoint_every=3)
    with pytest.raises(NonFiniteLossError, match=r"epoch 2 step 3: ce=nan, dis=nan, gap=nan\. The last good "
                                                 r"checkpoint is kept"):
        finetune(model, x, y, split, cfg, "concat", progress=False, checkpoint=ckpt)
    # Found at the next checkpoint (after epoch 2's step 4), before saving: the last checkpoint
    # on disk is the one after epoch 2's step 1.
    state = ckpt.load()
    assert (state["epoch"], state["step"]) == (1, 1)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert all(torch.isfinite(torch.tensor(state["history"][k])).all() for k in ("ce", "dis", "gap"))


# ---- fast path on CPU ----

def test_channels_last_and_data_on_device_match_the_plain_loop():
    x, y, split = _data()
    plain, fast = _model(), _model()
    torch.manual_seed(0)
    h1 = finetune(plain, x, y, split, _cfg(), "concat", progress=False)
    torch.manual_seed(0)
    h2 = finetune(fast, x, y, split, _cfg(channels_last=True, data_on_device=True), "concat", progress=False)
    assert fast.G[4].weight.is_contiguous(memory_format=torch.channels_last)  # second conv, 8 -> 16
    torch.testing.assert_close(torch.tensor(h2.ce), torch.tensor(h1.ce), rtol=1e-4, atol=1e-5)
    for (k, a), b in zip(plain.state_dict().items(), fast.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=k)


def test_bf16_autocast_runs_the_convolutions_in_bfloat16():
    x, y, split = _data()
    model, dtypes = _model(), set()
    model.G[0].register_forward_hook(lambda m, i, out: dtypes.add(out.dtype) if m.training else None)
    torch.manual_seed(0)
    hist = finetune(model, x, y, split, _cfg(amp="bf16", finetune_epochs=1), "separate", progress=False)
    assert dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay float32
    torch.manual_seed(0)
    ref = finetune(_model(), x, y, split, _cfg(finetune_epochs=1), "separate", progress=False)
    # Same first batch and weights: the first CE differs by bfloat16 rounding only (8-bit mantissa).
    assert hist.ce[0] != ref.ce[0] and hist.ce[0] == pytest.approx(ref.ce[0], rel=0.03)


@pytest.mark.parametrize("strategy", ["separate", "concat"])
def test_compiled_g_compiles_each_batch_shape_once_and_matches_eager(strategy):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, y, split = _data()
    cfg = _cfg(finetune_epochs=1, batch_size_unsup=4)  # two batch sizes: 8 labeled, 4 unlabeled
    compiled, eager = compile_model(_model(), backend="eager"), _model()
    torch.manual_seed(0)
    finetune(compiled, x, y, split, cfg, strategy, progress=False)
    graphs = counters["stats"]["unique_graphs"]
    # separate: shapes 8 and 4 in training, 20 in evaluation; concat: 8 (Step A), 12, and 20.
    assert graphs == 3
    torch.manual_seed(0)
    finetune(eager, x, y, split, cfg, strategy, progress=False)
    for (k, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
    finetune(compiled, x, y, split, dataclasses.replace(cfg, seed=1), strategy, progress=False)
    assert counters["stats"]["unique_graphs"] == graphs  # 5 more steps and an evaluation: no new graph
    # A new model of the same architecture (the next OOD set's stage) reuses the graphs too.
    finetune(compile_model(_model(seed=5), backend="eager"), x, y, split, cfg, strategy, progress=False)
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


# ---- the benchmark's pieces (benchmarks/run.py) ----

def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("bench_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_tensor_memory_counts_what_is_alive_at_once():
    bench = _bench()
    with bench.PeakTensorMemory() as m:
        a = torch.ones(2**20)  # 4 MiB
        b = torch.ones(2**19)  # 2 MiB, alive with a: 6 MiB
        del a
        c = torch.ones(2**18)  # 1 MiB: 3 MiB alive
        b.add_(1)  # in place: no new storage
    assert m.peak == 6 * 2**20 and m.current == 3 * 2**20
    del b, c


@pytest.mark.parametrize("strategy", ["separate", "concat"])
def test_the_benchmarks_raw_loop_does_the_helpers_work(strategy):
    # One batch per pass (N = batch size), so both loops see the same samples; the losses are
    # means, so the order inside the batch changes only the rounding.
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 12, 12, generator=g), torch.randint(10, (8,), generator=g)
    xu = torch.randn(8, 1, 12, 12, generator=g)
    split = bench.TransductiveSplit(x[:1], y[:1], xu[:1] + 3, xu[:4], y[:4], xu[4:])
    raw, helper = _model(), _model()
    bench.raw_loop(raw, x, y, xu, 1, strategy, 8, 8, "cpu")
    cfg = dataclasses.replace(bench._cfg("small_cnn", 8, 1, "cpu", "plain"), seed=0)
    finetune(helper, x, y, split, cfg, strategy, progress=False)
    for (k, a), b in zip(raw.state_dict().items(), helper.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=k)
