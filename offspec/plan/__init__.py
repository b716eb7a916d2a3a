"""The memory plan: the machine, what every kind of bytes costs, where each layer lives, the context and rows that
fit, and the predicted pass time. Arithmetic over shapes and the machine; it imports nothing that streams."""
