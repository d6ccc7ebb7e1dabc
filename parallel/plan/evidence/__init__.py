"""The published runs the planner is held against, and the fit of its constants: which rows fit, which are held out."""
