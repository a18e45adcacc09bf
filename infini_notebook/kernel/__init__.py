"""Kernel-side work on a running session: running cells and their output, watching waits
and releasing them, supervision (liveness, stacks, status), pull/push, the bench driver."""
