"""The Lightning layer: the LightningModule around :class:`mtmoe.mmoe.MMoE`, its metrics and callbacks."""
