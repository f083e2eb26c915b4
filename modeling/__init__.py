"""The model's internals, plain PyTorch (never torch_xla): each architecture's recursion scheme
registered in one place (schemes.py: yaml values, halting rule, config checks, checkpoint
recognition) and the halting exploration, attention's core (attention.py), each dense weight's
gradient summed over its uses per device (device_grads.py), the counter-based hash of the halting
exploration and the test-time noise (counter_hash.py), and config fields that declare their
allowed range (field_ranges.py). model.py builds TRM from these."""
