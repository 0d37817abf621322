"""The paper's tables (Markdown and LaTeX) and figures from the metrics, beside the paper's published
figures.
"""
