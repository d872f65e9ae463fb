"""Trial packs: many trials of one model structure trained at once as one model (a leading trial axis on every
tensor, ``torch.func.vmap`` over the plain modules): :mod:`~mtmoe.pack.stack` (the stacked tensors),
:mod:`~mtmoe.pack.model` (the packed forward and loss), :mod:`~mtmoe.pack.adam` (Adam per trial) and
:mod:`~mtmoe.pack.train` (early stopping, best weights, divergence and refill per trial)."""
