"""Matchers and rewrites from collective+matmul subgraphs to fluxcompile's fused ops."""

from .graph_pass import FluxcompilePass, rewrite_graph
from .report import Entry, GraphReport, Report

__all__ = ["Entry", "FluxcompilePass", "GraphReport", "Report", "rewrite_graph"]
