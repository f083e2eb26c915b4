"""Test-time compute: the settings (K trajectories, noise, depth D, noised latent) and their
directories (settings.py), K noisy trajectories per puzzle on the device and the selections
among them, best-Q, mode@K and pass@K (noisy_trajectories.py), the batches of K rows per puzzle
(batches.py), and the table, plot and report columns read back from a run's settings (curve.py)."""
