"""The pages of the window, one module each; every page renders `FleetSnapshot`s (and
events) from the bridge and calls the engine's commands through it."""
