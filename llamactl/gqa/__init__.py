"""convert-heads: multi-head attention to grouped-query attention, with its report."""
