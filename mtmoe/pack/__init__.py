"""The training engine: many trials of one model structure trained at once as one model, a leading trial axis on
every tensor (``fit`` trains a pack of one): :mod:`~mtmoe.pack.engine` (the packed step under ``torch.func.vmap``
over the plain modules, and each trial's early stopping, best weights and divergence), :mod:`~mtmoe.pack.stack`
(the stacked tensors), :mod:`~mtmoe.pack.adam` (Adam over all trials at once), :mod:`~mtmoe.pack.metrics` (every
trial's metrics on the device), :mod:`~mtmoe.pack.graphs` (CUDA graphs) and :mod:`~mtmoe.pack.memory` (a trial's
device memory)."""
