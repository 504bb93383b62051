"""Where the memory matrix lives: the interface (``base``), the one place a backend is chosen
(``select``), and the backends: ``numpy_backend`` (CPU) and ``cuda`` (CuPy, kernels in a ``.cu``)."""
