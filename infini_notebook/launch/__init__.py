"""What starts and ends processes: the store, the controller and its client, the ranks'
engine sets and spares, launchers (local, ssh, mpi, Slurm), the warm template and the
watchdog."""
