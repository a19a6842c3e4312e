"""Pure tensor math on the manifolds: no modules, no state, no I/O."""

from curvalign.geometry import euclidean, lorentz, product, sphere

__all__ = ["euclidean", "lorentz", "product", "sphere"]
