"""Native kernels: their C / C++ sources (``csrc``), the one path that builds and loads every native library of the
engine (``build``), what each library holds (``libraries``), and the installers' prebuilt levels (``prebuild``).
Imports nothing else of the engine: the rooms that call the kernels stand on it."""
