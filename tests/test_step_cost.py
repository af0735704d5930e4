"""The step-cost benchmark's launch model and counter (``benchmarks/step_cost.py``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import step_cost
from benchmarks.step_cost import (
    MTA_CHUNK,
    StepCounter,
    Variant,
    count_step,
    mta_launches,
    op_cost,
    prepare,
)
from mixprec.kernels import adamw
from mixprec.tools import live_tensor_bytes

aten = torch.ops.aten


def _meta(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.empty(n, device="meta", dtype=dtype) for n in numels]


@pytest.mark.parametrize(
    ("func", "lists", "limit"),
    [
        (aten._foreach_mul_.Scalar, 1, 110),  # depth 1: one list, in place
        (aten._foreach_add_.List, 2, 64),  # depth 2: self and other
        (aten._foreach_addcmul_.Scalar, 3, 48),  # depth 3
    ],
)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 110, 111, 300])
def test_foreach_op_over_n_small_tensors_counts_ceil_n_over_the_depth_limit(func, lists, limit, n):
    tensors = [_meta(*[10] * n) for _ in range(lists)]
    args: tuple = (*tensors, 2.0) if func is aten._foreach_mul_.Scalar else tuple(tensors)
    if func is aten._foreach_addcmul_.Scalar:
        args = (*tensors, 0.5)
    assert op_cost(func, args, {}, None).launches == math.ceil(n / limit)


def test_out_of_place_foreach_counts_its_output_list_in_the_depth():
    xs = _meta(*[10] * 100)
    out = _meta(*[10] * 100)
    assert op_cost(aten._foreach_mul_.Scalar, (xs, 2.0), {}, None).launches == 1  # depth 1
    assert op_cost(aten._foreach_mul.Scalar, (xs, 2.0), {}, out).launches == 2  # depth 2: 64


def test_blocks_limit_launches_every_320_chunks_of_65536_elements():
    assert mta_launches([320 * MTA_CHUNK], depth=1) == 1
    assert mta_launches([320 * MTA_CHUNK + 1], depth=1) == 2
    # 200 tensors of 4 chunks: 80 tensors fill 320 blocks before 110 tensors are queued.
    assert mta_launches([3 * MTA_CHUNK + 1] * 200, depth=1) == 3
    assert mta_launches([MTA_CHUNK + 1] * 200, depth=4) == 6  # 36 tensors (72 blocks) a launch
    assert mta_launches([0, 0, 5], depth=1) == 1  # empty tensors are skipped
    assert mta_launches([], depth=1) == 0
    assert mta_launches([10] * 771, depth=1, limits="cuda13") == 2
    with pytest.raises(ValueError, match="depth must be >= 1"):
        mta_launches([1], depth=0)


def test_foreach_off_cuda_fast_path_counts_one_launch_per_tensor():
    xs, ys = _meta(*[10] * 20), _meta(*[10] * 20, dtype=torch.bfloat16)
    assert op_cost(aten._foreach_add_.List, (xs, ys), {}, None).launches == 20  # dtypes differ
    assert op_cost(aten._foreach_copy_.default, (xs, ys), {}, None).launches == 1  # copy may cast
    strided = [torch.empty(4, 4, device="meta").t() for _ in range(3)]
    plain = [torch.empty(4, 4, device="meta") for _ in range(3)]
    assert op_cost(aten._foreach_add_.List, (plain, strided), {}, None).launches == 3


def test_fused_adamw_walks_four_lists_and_not_the_step_counters():
    n = 100
    params, grads, m, v = (_meta(*[1000] * n) for _ in range(4))
    steps = _meta(*[1] * n)
    args = (params, grads, m, v, [], steps)
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                  maximize=False)  # fmt: skip
    assert op_cost(aten._fused_adamw_.default, args, kwargs, None).launches == math.ceil(n / 36)


def test_in_place_foreach_and_fused_ops_count_what_they_write():
    """They return nothing: what they write comes from their schema's mutated lists."""
    xs, halves = _meta(*[10] * 3), _meta(*[10] * 3, dtype=torch.bfloat16)
    assert op_cost(aten._foreach_mul_.Scalar, (xs, 2.0), {}, None).nbytes == 2 * 3 * 40
    assert op_cost(aten._foreach_copy_.default, (xs, halves), {}, None).nbytes == 3 * (40 + 20)
    params, grads, m, v = (_meta(100) for _ in range(4))
    args = (params, grads, m, v, [], _meta(1))
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                  maximize=False)  # fmt: skip
    step = op_cost(aten._fused_adamw_.default, args, kwargs, None).nbytes
    assert step == 4 * 400 + 3 * 400 + 4  # reads p, g, m, v (and the step); writes p, m, v
    scale = torch.ones((), device="meta")
    unscaled = op_cost(aten._fused_adamw_.default, args, {**kwargs, "grad_scale": scale}, None)
    assert unscaled.nbytes == step + 4 + 400  # reads the scale; writes the gradients back


def test_views_cost_nothing_and_plain_ops_one_launch_with_their_bytes():
    x = torch.ones(4, 4)
    assert op_cost(aten.view.default, (x, [16]), {}, x.view(16)).launches == 0
    assert op_cost(aten.t.default, (x,), {}, x.t()).nbytes == 0
    assert op_cost(aten.empty_like.default, (x,), {}, torch.empty_like(x)).launches == 0
    add = op_cost(aten.add.Tensor, (x, x), {}, x + x)
    assert (add.launches, add.nbytes, add.matmul) == (1, 3 * 64, False)
    inplace = op_cost(aten.add_.Tensor, (x, x), {}, x)
    assert inplace.nbytes == 3 * 64  # self read and written, other read
    copy = op_cost(aten.copy_.default, (x, x), {}, x)
    assert copy.nbytes == 2 * 64  # copy_ only writes its destination
    mm = op_cost(aten.mm.default, (x, x), {}, x @ x)
    assert mm.matmul and mm.launches == 1
    empty = torch.ones(0)
    assert op_cost(aten.add.Tensor, (empty, empty), {}, empty + empty).launches == 0


def test_cat_batches_128_inputs_per_launch_when_dtypes_agree():
    xs = [torch.ones(2) for _ in range(200)]
    assert op_cost(aten.cat.default, (xs,), {}, torch.cat(xs)).launches == 2
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.bfloat16)]
    assert op_cost(aten.cat.default, (mixed,), {}, torch.cat(mixed)).launches == 2


def test_counter_splits_phases_and_counts_what_it_sees():
    x = torch.ones(3)
    with StepCounter() as counter:
        counter.phase = "forward"
        y = (x * 2).view(3, 1)  # one launch, one view
        counter.phase = "optimizer"
        torch._foreach_add_([x, x.clone()], 1.0)  # clone: 1, foreach over 2 tensors: 1
    assert counter.tallies["forward"].ops == 2 and counter.tallies["forward"].launches == 1
    assert counter.tallies["backward"].ops == 0
    assert counter.tallies["optimizer"].launches == 2
    assert y.shape == (3, 1)


def _tiny_counts(label: str) -> dict:
    variant = next(v for v in step_cost.VARIANTS if v.label == label)
    from mixprec.train.models import TransformerClassifier

    def factory() -> torch.nn.Module:
        return TransformerClassifier(num_classes=10, seq_len=4, token_dim=4, d_model=32,
                                     nhead=2, num_layers=1, dim_feedforward=64, dropout=0.0)  # fmt: skip

    gen = torch.Generator().manual_seed(0)
    work = step_cost.Workload("tiny", factory, torch.randn(2, 4, 4, generator=gen),
                              torch.randint(0, 10, (2,), generator=gen))  # fmt: skip
    baseline = live_tensor_bytes()  # the batch and whatever else lives already
    prepared = prepare(variant, work.factory, work.x)
    return count_step(prepared, work.x, work.y, warmup=1, baseline=baseline)


@pytest.mark.parametrize("label", ["autocast bf16", "lean bf16"])
def test_counts_are_deterministic_and_bytes_per_parameter_are_exact(label):
    first, second = _tiny_counts(label), _tiny_counts(label)
    strip = ("phases", "total")
    assert {k: first[k] for k in strip} == {k: second[k] for k in strip}
    assert all(first["phases"][p]["launches"] > 0 for p in step_cost.PHASES)
    # At rest: float32 weights + two float32 moments (12), or bfloat16 weights, moments
    # and Kahan buffers (8); at the step's peak the gradients (and temporaries) too.
    expected = {"autocast bf16": 12.0, "lean bf16": 8.0}[label]
    # (plus a few scalars: AdamW's step counters, the loss scale's state)
    assert first["bytes_per_param_at_rest"] == pytest.approx(expected, abs=0.02)
    assert first["bytes_per_param_step_peak"] > first["bytes_per_param_at_rest"]


@pytest.mark.parametrize(
    ("label", "eager_label", "mode", "at_rest"),
    [("lean fused bf16", "lean bf16", adamw.COMPENSATED, 8.0),
     ("lean stochastic fused bf16", "lean stochastic bf16", adamw.STOCHASTIC_ROUNDING, 6.0)],
)  # fmt: skip
def test_the_compiled_lean_step_is_priced_as_one_read_and_write_of_each_tensor(
    label, eager_label, mode, at_rest
):
    """The lean fused rows: the eager reference runs unpriced, and the call is priced as
    inductor's loops (kahan: 18 bytes per bfloat16 parameter, COMBO_NODES loops a
    launch); the rest of the step is priced as it runs, and less is moved than by the
    eager lean step."""
    fused, eager = _tiny_counts(label), _tiny_counts(eager_label)
    phase = fused["phases"]["optimizer"]
    launches = dict(phase["top_launches"])
    n_tensors = 19  # the tiny TransformerClassifier's parameter tensors
    assert launches[f"{mode}_adamw (compiled)"] == math.ceil(n_tensors / step_cost.COMBO_NODES)
    assert "sqrt" not in launches and "_fused_adamw_" not in launches
    assert "random_" not in launches  # stochastic: the noise is hashed in the loop
    assert phase["bytes"] < eager["phases"]["optimizer"]["bytes"]
    assert fused["phases"]["forward"] == eager["phases"]["forward"]
    assert fused["bytes_per_param_at_rest"] == pytest.approx(at_rest, abs=0.05)
    assert fused["bytes_per_param_step_peak"] < eager["bytes_per_param_step_peak"]


def test_the_compiled_o2_step_holds_no_float32_master_gradient():
    """The O2 fused row: the masters are stepped from the model's bfloat16 gradients
    (28 bytes per parameter in one loop), so the step's peak is autocast's 16 bytes
    per parameter, not O2's 20, and fewer bytes move than in the eager O2 step."""
    fused, eager = _tiny_counts("O2 fused bf16"), _tiny_counts("O2 bf16")
    phase = fused["phases"]["optimizer"]
    launches = dict(phase["top_launches"])
    # Priced as on a GPU, where the finite check is apart from the step (a norm pass).
    assert launches[f"{adamw.FLOAT32_MASTERS}_adamw (compiled)"] == math.ceil(19 / step_cost.COMBO_NODES)
    assert "_fused_adamw_" not in launches and "_foreach_copy_" not in launches
    assert "_foreach_norm" in launches
    assert phase["bytes"] < eager["phases"]["optimizer"]["bytes"]
    assert fused["bytes_per_param_at_rest"] == pytest.approx(14.0, abs=0.05)
    assert fused["bytes_per_param_step_peak"] == pytest.approx(16.0, abs=0.05)
    assert eager["bytes_per_param_step_peak"] == pytest.approx(20.0, abs=0.1)


def test_the_compiled_split8_adamw8bit_step_holds_no_float32_master_or_moment():
    """split8 masters around AdamW8bit, fused: one priced loop per parameter reads and
    writes the weights, corrections, codes and block scales; the state at rest is the
    eager step's, and the peak holds no float32 master, master gradient or moment."""
    fused, eager = _tiny_counts("O2 split8+AdamW8bit fused bf16"), _tiny_counts(
        "O2 split8+AdamW8bit bf16")
    phase = fused["phases"]["optimizer"]
    launches = dict(phase["top_launches"])
    assert launches[f"{adamw.LOW_BITS8_MOMENTS8}_adamw (compiled)"] == math.ceil(19 / step_cost.COMBO_NODES)
    assert "sqrt" not in launches and "random_" not in launches
    assert phase["launches"] < eager["phases"]["optimizer"]["launches"]
    assert phase["bytes"] < eager["phases"]["optimizer"]["bytes"]
    # (plus the fused step's hyperparameter vector: 32 bytes)
    assert fused["bytes_per_param_at_rest"] == pytest.approx(
        eager["bytes_per_param_at_rest"], abs=0.01)
    # the peak: the rest, plus the bfloat16 gradients (2) and the step's few scalars
    extra = fused["bytes_per_param_step_peak"] - fused["bytes_per_param_at_rest"]
    assert 2.0 <= extra < 2.1
    assert eager["bytes_per_param_step_peak"] - eager["bytes_per_param_at_rest"] > 10.0


def test_lean_optimizer_launches_do_not_grow_with_parameter_tensors():
    """The lean step gathers, rounds and scatters runs of parameters: what it adds to O3's
    optimizer phase is the same for a model of 8 tensors as for one of 64."""
    from mixprec import amp

    def launches(level: str, n: int) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n // 2)])
        inner = torch.optim.AdamW(model.parameters(), fused=True)
        model, opt = amp.initialize(model, inner, level=level, dtype=torch.bfloat16)
        x = torch.randn(2, 4)
        for _ in range(2):
            opt.scale_loss(model(x).float().sum()).backward()
            with StepCounter() as counter:
                counter.phase = "optimizer"
                opt.step()
            opt.zero_grad()
        return counter.tallies["optimizer"].launches

    lean_8, lean_64 = (
        launches("lean", 8) - launches("O3", 8),
        launches("lean", 64) - launches("O3", 64),
    )
    assert lean_8 == lean_64 <= 16


@pytest.mark.slow
def test_command_line_writes_its_own_section(tmp_path, capsys):
    report = tmp_path / "B.md"
    report.write_text("# Benchmarks\n\n## 10. Before\n\nkept\n", encoding="utf-8")
    args = ["--only", "O3 bf16", "--repeats", "0", "--warmup", "1", "--markdown", str(report),
            "--out", str(tmp_path / "sc.json")]  # fmt: skip
    assert step_cost.main(args) == 0
    notes = f"{step_cost.NOTES_MARKER}\nhand-written\n"
    report.write_text(report.read_text(encoding="utf-8") + notes, encoding="utf-8")
    assert step_cost.main(args) == 0  # a second run replaces the section, once
    text = report.read_text(encoding="utf-8")
    assert text.count(step_cost.SECTION_TITLE) == 1 and "kept" in text and "| O3 bf16 |" in text
    assert text.count("hand-written") == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        step_cost.main(["--only", "O9 bf16"])
    assert "unknown recipe" in capsys.readouterr().err


def test_variant_anchor_is_the_torch_recipe_of_its_dtype():
    assert Variant("x", torch.bfloat16, "O2").anchor == "autocast bf16"
    assert Variant("y", torch.float16, "O2").anchor == "autocast+GradScaler fp16"


def test_the_gpu_check_runs_on_a_cpu_with_the_estimates_and_no_measurements(tmp_path):
    """``benchmarks.gpu_step_cost`` on a CPU: every recipe's estimate, no profiler columns."""
    from benchmarks import gpu_step_cost

    labels = "autocast bf16,lean bf16"
    assert gpu_step_cost.main(["--out", str(tmp_path), "--device", "cpu", "--small",
                               "--only", labels]) == 0  # fmt: skip
    doc = json.loads((tmp_path / "gpu_step_cost.json").read_text(encoding="utf-8"))
    assert [r["label"] for r in doc["rows"]] == labels.split(",")
    for row in doc["rows"]:
        assert row["predicted"]["optimizer_launches"] > 0 and row["predicted"]["step_launches"] > 0
        assert row["measured"] == {"step": None, "optimizer": None}
    assert doc["copy_bandwidth"] is None
    table = (tmp_path / "gpu_step_cost.md").read_text(encoding="utf-8")
    assert table.count("| lean bf16 |") == 2  # the counts, and the phase times
    for row in doc["rows"]:
        times = row["phase_times"]
        assert list(times) == ["forward", "backward", "optimizer"]
        assert all(0 < t["host_ms"] <= t["total_ms"] for t in times.values())


def test_the_finite_check_in_the_compiled_step_is_priced_as_its_reductions():
    """A ``found_inf`` of ``None`` (the step checks the gradients itself, as a CPU run
    does): every gradient read once more, in a reduction per parameter grouped as the
    loops are, and one launch more that writes the verdict."""
    w = [torch.ones(4, dtype=torch.bfloat16)]
    args = ["kahan", w, w, w, w, w, [torch.zeros(())], [torch.ones(1)],
            [torch.ones(4, dtype=torch.float64)], torch.zeros(())]  # fmt: skip
    apart = step_cost.fused_lean_cost(tuple(args))
    args[9] = None
    inside = step_cost.fused_lean_cost(tuple(args))
    assert inside.launches == 2 * apart.launches + 1
    assert inside.nbytes == apart.nbytes - 4 + 8 + 4  # no flag read; the gradient, the verdict
