"""Training speed on one GPU: ``strategy="auto"``, GPipeStrategy at K = 1, hand-written loops and compiled layers."""
