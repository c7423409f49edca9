"""Mixture of experts: the sparse blocks, their experts, routers, placement over the TP x PCP ranks, the start-up log."""
