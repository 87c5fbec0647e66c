"""sampler"""
