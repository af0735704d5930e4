"""Names the command line offers before torch loads: the amp levels and the model names.

``mixprec --help`` lists them as choices; this module imports nothing, so that the
help (and ``--version``) print without importing torch. :mod:`mixprec.train._loop` and
:mod:`mixprec.train.models` export them as ``AMP_LEVELS`` and ``MODEL_NAMES``.
"""


#: The ``amp_level`` values :class:`mixprec.train.Model` accepts: the names of
#: ``mixprec.amp.LEVEL_SPECS``, written out here since that table needs torch (a test
#: checks they match).
AMP_LEVELS = ("O0", "O1", "O2", "O3", "lean", "auto", "rewrite")
#: The names :func:`mixprec.train.models.build_model` builds (checked there at import).
MODEL_NAMES = ("lenet5", "mlp", "transformer")
