"""The Python runtime's guest side (runs inside WebAssembly, staged by build_pyrt)."""
