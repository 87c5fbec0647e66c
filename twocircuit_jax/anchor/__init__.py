"""anchor"""
