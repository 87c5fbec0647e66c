"""twocircuit_jax"""
