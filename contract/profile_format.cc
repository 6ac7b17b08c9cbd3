#include "contract/profile_format.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace sparsebalance {
namespace {

absl::Status LineError(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("profile line ", line, ": ", what));
}

absl::Status ParseShape(absl::string_view rest, int line, ModelShape* shape) {
  for (absl::string_view item :
       absl::StrSplit(rest, absl::ByAnyChar(" \t"), absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, '=');
    int value = 0;
    if (!absl::SimpleAtoi(kv.second, &value) || value < 0) {
      return LineError(line, absl::StrCat("shape field \"", item, "\" needs KEY=non-negative int"));
    }
    if (kv.first == "heads") {
      shape->heads = value;
    } else if (kv.first == "head_dim") {
      shape->head_dim = value;
    } else if (kv.first == "block_size") {
      shape->block_size = value;
    } else if (kv.first == "local_blocks") {
      shape->local_blocks = value;
    } else if (kv.first == "layers") {
      shape->layers = value;
    } else {
      return LineError(line, absl::StrCat("unknown shape field \"", kv.first,
                                          "\" (known: heads, head_dim, block_size, local_blocks)"));
    }
  }
  if (shape->heads < 1 || shape->head_dim < 1) {
    return LineError(line, "shape needs heads >= 1 and head_dim >= 1");
  }
  if (shape->block_size != 64 && shape->block_size != 128) {
    return LineError(line, "shape block_size must be 64 or 128");
  }
  return absl::OkStatus();
}

// A line break would end the field early and start a bogus line: spaces instead.
std::string OneLine(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

}  // namespace

absl::StatusOr<ProfileTable> ParseProfileTable(absl::string_view text) {
  ProfileTable table;
  bool saw_magic = false;
  bool saw_shape = false;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipWhitespace());
    if (!saw_magic) {
      if (fields.size() != 2 || fields[0] != "sparsebalance-profile") {
        return LineError(line_number, "expected the header \"sparsebalance-profile 1\"");
      }
      if (fields[1] != "1") {
        return LineError(line_number, absl::StrCat("unsupported profile version ", fields[1],
                                                   "; this build reads version 1"));
      }
      saw_magic = true;
      continue;
    }
    if (fields[0] == "device") {
      table.device = std::string(absl::StripAsciiWhitespace(line.substr(fields[0].size())));
      continue;
    }
    if (fields[0] == "shape") {
      absl::Status status = ParseShape(line.substr(fields[0].size()), line_number, &table.shape);
      if (!status.ok()) return status;
      saw_shape = true;
      continue;
    }
    if (fields.size() != 3) {
      return LineError(line_number, "a data row needs three fields: length density seconds");
    }
    ProfileRow row;
    if (!absl::SimpleAtoi(fields[0], &row.length) || row.length < 1) {
      return LineError(line_number,
                       absl::StrCat("length \"", fields[0], "\" is not a positive integer"));
    }
    if (!absl::SimpleAtod(fields[1], &row.density) || !(row.density > 0 && row.density <= 1)) {
      return LineError(line_number, absl::StrCat("density \"", fields[1], "\" is not in (0, 1]"));
    }
    if (!absl::SimpleAtod(fields[2], &row.seconds) || !std::isfinite(row.seconds) ||
        row.seconds <= 0) {
      return LineError(line_number,
                       absl::StrCat("seconds \"", fields[2], "\" is not a positive finite number"));
    }
    table.rows.push_back(row);
  }
  if (!saw_magic) return absl::InvalidArgumentError("profile is empty: no header line");
  if (!saw_shape) return absl::InvalidArgumentError("profile has no \"shape ...\" line");
  if (table.rows.empty()) return absl::InvalidArgumentError("profile has no data rows");
  return table;
}

std::string FormatProfileTable(const ProfileTable& table) {
  std::string out = "sparsebalance-profile 1\n";
  absl::StrAppend(&out, "device ", table.device.empty() ? "unknown" : OneLine(table.device), "\n");
  absl::StrAppend(&out, "shape heads=", table.shape.heads, " head_dim=", table.shape.head_dim,
                  " block_size=", table.shape.block_size,
                  " local_blocks=", table.shape.local_blocks, "\n");
  if (!table.note.empty()) absl::StrAppend(&out, "# ", OneLine(table.note), "\n");
  out += "# length(tokens) density seconds(one layer, forward+backward)\n";
  for (const ProfileRow& row : table.rows) {
    absl::StrAppend(&out, absl::StrFormat("%d %.6g %.9g\n", row.length, row.density, row.seconds));
  }
  if (table.breakdown.empty()) return out;
  out += "# length density attention_seconds linear_seconds active_blocks(all heads)\n";
  for (size_t i = 0; i < table.rows.size() && i < table.breakdown.size(); ++i) {
    const ProfileRow& row = table.rows[i];
    const ProfileBreakdown& part = table.breakdown[i];
    absl::StrAppend(
        &out, absl::StrFormat("#   %d %.6g %.6g %.6g %d\n", row.length, row.density,
                              part.attention_seconds, part.linear_seconds, part.active_blocks));
  }
  return out;
}

}  // namespace sparsebalance
