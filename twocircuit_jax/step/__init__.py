"""What runs on the device: the pure step and the programs built from it (jitted with explicit shardings).

programs.py is the one builder (circuits, circuit state shardings, every jitted program), train_step.py the
optimizer tick, grpo_step.py the GRPO loss through the codecs, circuit_state.py the state pytree, losses.py the
token losses, abstract_step.py the same programs from shapes alone. The host trainer that calls them is train/.
"""
