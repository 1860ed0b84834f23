"""Training what the released checkpoint lacks: the DSpark draft stages (`dspark_train`)."""
