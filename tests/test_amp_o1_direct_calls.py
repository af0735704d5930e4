"""O1 is ``torch.autocast`` wherever the model's modules run: called through the root, a
submodule called directly (a GAN's discriminator, an autoencoder's encoder), called from
another module's forward, and under ``torch.compile``. Each call that enters the model
is one autocast region, as ``with torch.autocast(...)`` around that call: outputs cast to
float32 on the way out (as the root's), gradients and BatchNorm statistics bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from amp_internals import call_state_left, calls_left
from torch import nn

from mixprec import amp

F32 = torch.float32
LATENT, IMAGE = 4, 8


def autocast_supports(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype):
            return True
    except RuntimeError:
        return False


DTYPES = [
    torch.bfloat16,
    pytest.param(
        torch.float16,
        marks=pytest.mark.skipif(not autocast_supports(torch.float16), reason="no CPU autocast"),
    ),
]


class GAN(nn.Module):
    """Lightning's GAN template in small: the root's forward is the generator, and the
    training step calls ``self.discriminator`` directly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(
            nn.Linear(LATENT, 16), nn.BatchNorm1d(16, 0.8), nn.LeakyReLU(0.2),
            nn.Linear(16, IMAGE), nn.Tanh(),
        )  # fmt: skip
        self.discriminator = nn.Sequential(
            nn.Linear(IMAGE, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def batch(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def in_autocast(dtype: torch.dtype, call):
    """``call()`` inside its own ``torch.autocast`` region: what O1 promises for each call
    that enters the model."""
    with torch.autocast("cpu", dtype):
        return call()


def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.dtype == F32, name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(b, c), name  # BatchNorm statistics


def gan_step(model: nn.Module, dtype: torch.dtype, autocast_each_call: bool) -> list[torch.Tensor]:
    """A discriminator step and a generator step of the GAN template, on the model's
    gradients; each module call in its own autocast region when asked (the reference)."""
    z, images = batch(6, LATENT), batch(6, IMAGE, seed=2).tanh()
    valid, fake = torch.ones(6, 1), torch.zeros(6, 1)

    def call(f, *args):
        return in_autocast(dtype, lambda: f(*args)).float() if autocast_each_call else f(*args)

    generated = call(model, z)
    real_loss = F.binary_cross_entropy_with_logits(call(model.discriminator, images), valid)
    fake_loss = F.binary_cross_entropy_with_logits(
        call(model.discriminator, generated.detach()), fake
    )
    ((real_loss + fake_loss) / 2).backward()
    g_loss = F.binary_cross_entropy_with_logits(call(model.discriminator, generated), valid)
    g_loss.backward()
    return [generated, real_loss, fake_loss, g_loss]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_gans_discriminator_called_directly_is_torch_autocast_bit_for_bit(dtype):
    model, reference = GAN(), GAN()
    amp.initialize(model, level="O1", dtype=dtype)
    got = gan_step(model, dtype, autocast_each_call=False)
    want = gan_step(reference, dtype, autocast_each_call=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == F32 and torch.equal(g, w)
    assert_same_grads(model, reference)
    # Not float32's numbers: the discriminator did run in low precision.
    plain = GAN()
    assert not torch.equal(plain.discriminator(got[0].detach()), model.discriminator(got[0]))
    assert call_state_left() == {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_encoder_called_directly_and_from_another_modules_forward_is_torch_autocast(dtype):
    """``model.encoder(x)`` in user code, and the encoder called from the forward of a
    module outside the model (a probe head, float32): the encoder under autocast, the
    head as it is."""
    model, reference = AutoEncoder(), AutoEncoder()
    amp.initialize(model, level="O1", dtype=dtype)
    torch.manual_seed(3)
    head = nn.Linear(4, 2)

    class Probe(nn.Module):
        def __init__(self, encoder: nn.Module) -> None:
            super().__init__()
            self.encoder, self.head = encoder, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    x = batch(5, 8)
    codes = model.encoder(x)
    want = in_autocast(dtype, lambda: reference.encoder(x)).float()
    assert codes.dtype == F32 and torch.equal(codes, want)
    probed = Probe(model.encoder)(x)
    ref_head = copy.deepcopy(head)
    ref_probed = ref_head(in_autocast(dtype, lambda: reference.encoder(x)).float())
    assert torch.equal(probed, ref_probed)
    (codes.square().sum() + probed.sum()).backward()
    (want.square().sum() + ref_probed.sum()).backward()
    assert_same_grads(model, reference)
    assert torch.equal(head.weight.grad, ref_head.weight.grad)
    # The whole model through the root is still one region, as before.
    assert torch.equal(model(x), in_autocast(dtype, lambda: reference(x)).float())
    assert call_state_left() == {} and all(calls_left(m) == {} for m in model.modules())


def test_one_autocast_region_per_call_however_deep():
    """Modules called inside an open region do nothing of their own: a forward through
    the root enters torch.autocast once, and so does one through a submodule."""
    model, _ = amp.initialize(AutoEncoder(), level="O1", dtype=torch.bfloat16)
    entered = []
    real = torch.autocast.__enter__

    def counting(self):
        entered.append(self.fast_dtype)
        return real(self)

    x = batch(2, 8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.autocast, "__enter__", counting)
        model(x)
        model.encoder(x)
        model.encoder[0](x)
    assert entered == [torch.bfloat16] * 3


def test_a_module_called_inside_its_own_call_leaves_the_region_with_the_outer_call():
    """A module that calls itself (a recursive cell): the inner call's hooks pair with
    each other, the region ends with the outer call, and the numbers are autocast's."""

    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
            h = self.lin(x)
            # A torch function after the inner call: it must still run under autocast.
            return torch.matmul(self(h.tanh(), depth - 1), self.lin.weight) if depth else h

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.cell = Recursive()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cell(x)

    model, reference = Model(), Model()
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    x = batch(3, 4)
    got = model.cell(x)
    want = in_autocast(torch.bfloat16, lambda: reference.cell(x)).float()
    assert got.dtype == F32 and torch.equal(got, want)
    assert call_state_left() == {} and calls_left(model.cell) == {}
    assert not torch.is_autocast_enabled("cpu")


def test_a_float32_island_called_directly_stays_float32():
    """``keep_batchnorm_fp32=True``: a BatchNorm called by itself computes in float32, as
    it does inside the model; the layers around it called directly run under autocast."""
    model, _ = amp.initialize(GAN(), level="O1", dtype=torch.bfloat16, keep_batchnorm_fp32=True)
    h = batch(6, 16)
    bn = copy.deepcopy(model.generator[1])
    assert torch.equal(model.generator[1](h), F.batch_norm(
        h, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, bn.momentum, bn.eps
    ))  # fmt: skip
    layer = model.generator[0]
    assert torch.equal(layer(batch(2, LATENT)), in_autocast(
        torch.bfloat16, lambda: F.linear(batch(2, LATENT), layer.weight, layer.bias)
    ).float())  # fmt: skip


def test_a_compiled_submodule_called_directly_is_torch_autocast():
    model, reference = AutoEncoder(), AutoEncoder()
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    x = batch(5, 8)
    dynamo.reset()
    try:
        compiled = torch.compile(model.encoder, backend="eager")
        for _ in range(2):
            got = compiled(x)
            want = in_autocast(torch.bfloat16, lambda: reference.encoder(x)).float()
            assert got.dtype == F32 and torch.equal(got, want)
        got.sum().backward()
        want.sum().backward()
        assert_same_grads(model.encoder, reference.encoder)
        assert call_state_left() == {} and not torch.is_autocast_enabled("cpu")
    finally:
        dynamo.reset()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated", "ignore::UserWarning")
def test_lightnings_manual_optimization_gan_at_o1_is_lightnings_bf16_mixed_bit_for_bit(tmp_path):
    """Lightning's GAN template (manual optimization, ``self.discriminator(...)`` called
    in ``training_step``) trained with mixprec's plugin at O1 and with Lightning's own
    ``precision="bf16-mixed"``: the same parameters, bit for bit."""
    L = pytest.importorskip("lightning")
    from mixprec.integrations.lightning import MixprecPrecision

    class LitGAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            gan = GAN()
            self.generator, self.discriminator = gan.generator, gan.discriminator
            self.automatic_optimization = False

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch, batch_idx):
            (images,) = batch
            opt_g, opt_d = self.optimizers()
            z = torch.randn(images.shape[0], LATENT).type_as(images)
            valid = torch.ones(images.size(0), 1).type_as(images)
            self.toggle_optimizer(opt_g)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), valid)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            real_loss = F.binary_cross_entropy_with_logits(self.discriminator(images), valid)
            fake = torch.zeros(images.size(0), 1).type_as(images)
            fake_loss = F.binary_cross_entropy_with_logits(
                self.discriminator(self(z).detach()), fake
            )
            self.manual_backward((real_loss + fake_loss) / 2)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)

        def configure_optimizers(self):
            adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.5, 0.999))  # noqa: E731
            return [adam(self.generator), adam(self.discriminator)]

    def train(**precision) -> list[torch.Tensor]:
        module = LitGAN()
        images = torch.rand(16, IMAGE, generator=torch.Generator().manual_seed(1)) * 2 - 1
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=4)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, default_root_dir=tmp_path,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            **precision,
        )  # fmt: skip
        torch.manual_seed(5)
        trainer.fit(module, loader)
        return [p.detach().clone() for p in module.parameters()]

    theirs = train(precision="bf16-mixed")
    plugin = MixprecPrecision("O1", torch.bfloat16, device="cpu", log_metrics=False)
    ours = train(plugins=[plugin])
    for mine, want in zip(ours, theirs, strict=True):
        assert mine.dtype == F32 and torch.equal(mine, want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_recomputes_as_its_forward_ran(reentrant):
    """``torch.utils.checkpoint`` calls the block again in the backward, outside O1's
    region but under the autocast state of the forward: the block runs there as it is
    (its low-precision input kept), so the recomputation matches the forward and the
    gradients are autocast's."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(4, 8)
            self.block = nn.Sequential(nn.GELU(), nn.Linear(8, 8), nn.Tanh())
            self.out = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)  # bfloat16 under autocast: the block's input
            return self.out(checkpoint(self.block, h, use_reentrant=reentrant))

    from torch.utils.checkpoint import checkpoint

    model, reference = Checkpointed(), Checkpointed()
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    x = batch(3, 4)
    out = model(x)
    want = in_autocast(torch.bfloat16, lambda: reference(x)).float()
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    assert_same_grads(model, reference)
    assert call_state_left() == {}
