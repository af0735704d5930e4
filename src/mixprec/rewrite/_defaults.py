"""The default op lists of the rewrite, with the reason for each group.

Op names are short ATen names (see :mod:`mixprec.rewrite._lists` for the naming).
The four contested entries are decided here, each with its reason next to it:
``softmax`` and ``log_softmax`` and ``layer_norm`` are Deny, ``batch_norm`` is Infer.

>>> "addmm" in ALLOW, "lstm" in ALLOW, "softmax" in DENY, "batch_norm" in INFER, "view" in CLEAR
(True, True, True, True, True)
"""


ALLOW = frozenset(
    {
        # Matrix products: tensor cores / AMX / AVX512-BF16 units; accumulation
        # happens in float32 inside the kernels.
        "linear",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "addbmm",
        "baddbmm",
        "einsum",
        "mv",
        "tensordot",
        # Convolutions and their transposes.
        "conv1d",
        "conv2d",
        "conv3d",
        "convolution",
        "_convolution",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        # Fused attention: the kernels keep the softmax statistics in float32.
        "scaled_dot_product_attention",
        # Recurrent layers and cells (nn.LSTM, nn.GRU, nn.RNN and their cells): each
        # step is two matrix products (accumulated in float32 by the kernels) and
        # bounded gate activations (sigmoid, tanh); the classic allow list holds the
        # recurrent ops too. The initial hidden and cell states are cast with the
        # input, the weights like any other parameter.
        "lstm",
        "gru",
        "rnn_tanh",
        "rnn_relu",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "mkldnn_rnn_layer",
    }
)

DENY = frozenset(
    {
        # Exponentials and logarithms: overflow above ~11 (exp in float16) or lose
        # the small values.
        "exp",
        "exp2",
        "expm1",
        "pow",
        "log",
        "log1p",
        "log2",
        "log10",
        "logsumexp",
        # Reductions accumulate many terms: float16 sums lose small addends.
        "sum",
        "nansum",
        "mean",
        "nanmean",
        "prod",
        "cumsum",
        "cumprod",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "norm",
        "linalg_vector_norm",
        "linalg_norm",
        "frobenius_norm",
        "dist",
        "cdist",
        "cosine_similarity",
        # softmax (contested, kept Deny): exponentiates and sums a whole row; the
        # small probabilities underflow float16 (smallest normal 6e-5) and feed logs
        # and losses. Attention through scaled_dot_product_attention is unaffected:
        # that kernel keeps its own float32 softmax statistics.
        "softmax",
        "_softmax",
        # log_softmax (contested, kept Deny): log of small probabilities; its large
        # negative outputs lose their low digits in float16, and it feeds nll_loss.
        "log_softmax",
        "_log_softmax",
        # Losses: reductions over the batch, often of logs.
        "cross_entropy_loss",
        "nll_loss",
        "nll_loss_nd",
        "nll_loss2d",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "poisson_nll_loss",
        "soft_margin_loss",
        "multilabel_margin_loss",
        "multi_margin_loss",
        "margin_ranking_loss",
        "hinge_embedding_loss",
        "cosine_embedding_loss",
        "triplet_margin_loss",
        "ctc_loss",
        # layer_norm (contested, kept Deny): normalises a transformer's residual
        # stream, whose values must stay float32 between blocks; like autocast on
        # CUDA, it runs in float32.
        "layer_norm",
        "native_layer_norm",
        "rms_norm",
        # group/instance norm: per-sample statistics over few elements, as layer_norm.
        "group_norm",
        "native_group_norm",
        "instance_norm",
    }
)

INFER = frozenset(
    {
        # Elementwise arithmetic (bias add, residual add, scaling).
        "add",
        "sub",
        "rsub",
        "mul",
        "div",
        "true_divide",
        "addcmul",
        "addcdiv",
        "lerp",
        "square",
        "sqrt",
        "rsqrt",
        "reciprocal",
        # Smooth activations: bounded outputs, computed in float32 registers.
        "gelu",
        "tanh",
        "sigmoid",
        "elu",
        "selu",
        "celu",
        "silu",
        "mish",
        "softplus",
        "hardswish",
        "hardsigmoid",
        "hardtanh",
        "leaky_relu",
        "prelu",
        "erf",
        # Averaging pools and interpolation: a few terms each.
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "upsample_bilinear2d",
        "upsample_linear1d",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        # Dropout scales by 1/(1-p): exact enough in any float type.
        "dropout",
        "feature_dropout",
        "alpha_dropout",
        "feature_alpha_dropout",
        "native_dropout",
        # batch_norm (contested, made Infer as fused batch norm usually is): the
        # PyTorch kernels accept a float16/bfloat16 input with float32 weight, bias
        # and running statistics, and accumulate the batch statistics in float32.
        # The rewrite never casts those four arguments, so the running statistics
        # stay float32 master values updated in place, and conv -> batch_norm ->
        # relu -> conv stays in low precision with no cast in between.
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training",
    }
)

CLEAR = frozenset(
    {
        # Views and layout.
        "reshape",
        "view",
        "_unsafe_view",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "t",
        "mT",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "contiguous",
        "clone",
        "alias",
        "detach",
        "repeat",
        "tile",
        "flip",
        "roll",
        "pixel_shuffle",
        "pixel_unshuffle",
        # Joining and splitting.
        "cat",
        "concat",
        "stack",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        # Selection and indexing.
        "getitem",
        "select",
        "slice",
        "narrow",
        "index",
        "index_select",
        "gather",
        "masked_fill",
        "where",
        "topk",
        "sort",
        # Piecewise-linear and order-based ops: exact in any float type.
        "relu",
        "relu6",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool2d_with_indices",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "max",
        "min",
        "amax",
        "amin",
        "maximum",
        "minimum",
        "clamp",
        "clamp_min",
        "clamp_max",
        "clip",
        "abs",
        "neg",
        "sign",
        # Rounding to integers is exact in any float format that holds the value (the classic
        # ClearList names Floor).
        "floor",
        "ceil",
        "round",
        "trunc",
        "argmax",
        "argmin",
        "eq",
        "ne",
        "gt",
        "ge",
        "lt",
        "le",
        "isnan",
        "isinf",
        "isfinite",
        # Padding and nearest-neighbour resizing copy values.
        "pad",
        "constant_pad_nd",
        "reflection_pad1d",
        "reflection_pad2d",
        "replication_pad1d",
        "replication_pad2d",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        # Factories that take their dtype from the graph.
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "zeros",
        "ones",
        "full",
        "empty",
        "scalar_tensor",
    }
)
