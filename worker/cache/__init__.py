"""The worker's row cache: rows kept with per-row staleness bounds (HET's two bounds), their slots, compiled passes and combined pushes."""
