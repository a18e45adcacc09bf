"""What runs inside a rank (an ipyparallel engine, or a torchrun process for exported
scripts): bootstrap, the threads beside cells, output streams, the wait probe, post-mortem,
bench kernels and the shared-memory transport. The kernel calls these through ipyparallel's
``apply`` by module and name."""
