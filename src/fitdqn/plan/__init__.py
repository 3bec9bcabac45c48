"""The memory plan: every consumer as a component of the one assembled system, the batch chosen last."""
