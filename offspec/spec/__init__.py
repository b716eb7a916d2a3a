"""Speculation: token trees and how they grow, verification, sampling, n-gram branches, calibration."""
