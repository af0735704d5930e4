"""Which module types and torch functions run in low precision, and which in float32.

The *white list* (allow list) holds what is numerically safe and fast in float16 /
bfloat16: matrix products and convolutions, as module types and as functions. The
*black list* (deny list) holds what must stay float32: normalisation layers and the
functions that ``torch.autocast`` runs in float32 on CUDA. How each level uses them,
and what an entry may be, is in the levels guide (docs/guides/levels.md).

>>> import torch
>>> torch.nn.Linear in get_white_list(), torch.nn.LayerNorm in get_black_list()
(True, True)
>>> get_white_list() is get_white_list()        # copies: edit freely
False
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import get_overridable_functions

_WHITE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.RNN,
    nn.LSTM,
    nn.GRU,
    nn.RNNCell,
    nn.LSTMCell,
    nn.GRUCell,
    nn.PReLU,
    # Its projections are raw Parameters fed to F.multi_head_attention_forward: listing
    # the module casts them (cached) and runs every matmul inside it low.
    nn.MultiheadAttention,
)

_WHITE_FUNCTIONS: tuple[Any, ...] = (
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.baddbmm,
    torch.addmm,
    torch.addbmm,
    torch.einsum,
    F.linear,
    F.bilinear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    F.prelu,
    F.scaled_dot_product_attention,
)

#: The normalisation layers: the default deny list's modules, which O2 keeps float32 (and
#: O1 with ``keep_batchnorm_fp32=True``).
BLACK_MODULES: tuple[type[nn.Module], ...] = tuple(
    cls
    for cls in (
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
        nn.LazyBatchNorm1d,
        nn.LazyBatchNorm2d,
        nn.LazyBatchNorm3d,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),  # torch >= 2.4
        nn.LocalResponseNorm,
    )
    if cls is not None
)


#: The loss functions of the deny list. Listed at any level, they run in float32 and
#: their output stays float32 (as under ``torch.autocast``): a loss is the end of the
#: computation, never the input of a low-precision layer.
LOSS_FUNCTIONS: tuple[Any, ...] = (
    F.cross_entropy,
    F.nll_loss,
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.kl_div,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.poisson_nll_loss,
    F.gaussian_nll_loss,
    F.cosine_embedding_loss,
    F.hinge_embedding_loss,
    F.margin_ranking_loss,
    F.soft_margin_loss,
    F.multi_margin_loss,
    F.multilabel_margin_loss,
    F.multilabel_soft_margin_loss,
    F.triplet_margin_loss,
)


# As torch.autocast's float32 list on CUDA, for the functions a model's forward calls.
_BLACK_FUNCTIONS: tuple[Any, ...] = (
    F.softmax,
    F.log_softmax,
    F.softmin,
    F.layer_norm,
    F.group_norm,
    F.cosine_similarity,
    F.softplus,
    F.pdist,
    torch.cdist,
    torch.dist,
    torch.norm,
    torch.renorm,
    torch.exp,
    torch.expm1,
    torch.log,
    torch.log2,
    torch.log10,
    torch.log1p,
    torch.pow,
    torch.rsqrt,
    torch.reciprocal,
    torch.logsumexp,
    torch.sum,
    torch.prod,
    torch.cumsum,
    torch.cumprod,
    torch.acos,
    torch.asin,
    torch.cosh,
    torch.sinh,
    torch.tan,
    torch.erfinv,
    *LOSS_FUNCTIONS,
)


def get_white_list() -> list[Any]:
    """A copy of the default allow list: module types, then functions.

    O1 given exactly the defaults runs ``torch.autocast`` (its per-device lists
    decide); edit a copy to give O1 lists of your own, which it then applies itself.

    >>> import torch
    >>> white = get_white_list() + [torch.nn.Embedding]  # O1 runs these, and only these, low
    >>> torch.nn.Linear in white and torch.matmul in white
    True
    """
    return [*_WHITE_MODULES, *_WHITE_FUNCTIONS]


def get_black_list() -> list[Any]:
    """A copy of the default deny list: normalisation module types (float32 at O2),
    then the functions ``torch.autocast`` runs float32 on CUDA (O1 with lists of
    the user's own; see :func:`get_white_list`), the loss functions last. Listed at
    O2/O3, a function runs in float32 and hands back the region's dtype, but a loss
    function's output stays float32 (a loss computed inside the forward).

    >>> import torch
    >>> torch.nn.BatchNorm2d in get_black_list(), torch.nn.functional.softmax in get_black_list()
    (True, True)
    """
    return [*BLACK_MODULES, *_BLACK_FUNCTIONS]


@functools.lru_cache(maxsize=1)
def _interceptable() -> frozenset:
    return frozenset(f for fs in get_overridable_functions().values() for f in fs)


def _namesakes(func: Any) -> set[Any]:
    """``func`` and the same-named torch / functional / Tensor functions."""
    name = getattr(func, "__name__", None)
    found = {func}
    if name is None:
        return found
    for namespace in (torch, F, torch.Tensor):
        other = getattr(namespace, name, None)
        if other is not None and other in _interceptable():
            found.add(other)
    if name == "matmul":
        found.update({torch.Tensor.__matmul__, torch.Tensor.__rmatmul__})
    return found


def is_default(white: tuple[Any, ...] | None, black: tuple[Any, ...] | None) -> bool:
    """Whether O1's lists are the defaults (left out, or passed as they are), which
    O1 runs as ``torch.autocast`` itself."""
    return (white is None or set(white) == set(get_white_list())) and (
        black is None or set(black) == set(get_black_list())
    )


def check_list(name: str, value: Any) -> tuple[Any, ...] | None:
    """Validate a user's white or black list; return it as a tuple (``None`` stays)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, type)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be a list of nn.Module types and torch functions, got "
            f"{type(value).__name__} {value!r}; e.g. {name}=[torch.nn.Linear, torch.matmul]"
        )
    items = tuple(value)
    for item in items:
        if isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise TypeError(
                    f"{name} entry {item!r} is a class but not an nn.Module subclass; "
                    "list module types such as torch.nn.Linear"
                )
        elif isinstance(item, nn.Module):
            raise TypeError(
                f"{name} entry {type(item).__name__}(...) is a module instance; list its type, "
                f"{type(item).__name__}, or give the instance its own policy with "
                "mixprec.amp.set_policy / to_float"
            )
        elif item not in _interceptable():
            raise TypeError(
                f"{name} entry {item!r} is not a torch function that __torch_function__ can "
                "intercept (torch.*, torch.nn.functional.*, torch.Tensor methods); put the code "
                "in an nn.Module and list the module's type instead"
            )
    return items


def split_list(items: Iterable[Any]) -> tuple[tuple[type[nn.Module], ...], frozenset]:
    """``(module types, functions with their namesakes)`` of a checked list."""
    modules = tuple(item for item in items if isinstance(item, type))
    functions: set[Any] = set()
    for item in items:
        if not isinstance(item, type):
            functions |= _namesakes(item)
    return modules, frozenset(functions)
