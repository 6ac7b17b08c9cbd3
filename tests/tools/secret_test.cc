// Random secrets and their comparison (tools/secret.h): bytes and hex of the asked length,
// different on every draw, a comparison that looks at whole strings, HMAC-SHA256 as RFC 4231
// computes it, SHA-256, and challenge-response proofs that cover every field.
#include "tools/secret.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"

namespace sparsebalance::tools {
namespace {

TEST(SecretTest, RandomHexHasTheAskedLengthInHexDigitsAndDiffersEveryDraw) {
  std::set<std::string> seen;
  for (int n : {0, 1, 7, 64}) {
    absl::StatusOr<std::string> hex = RandomHex(n);
    ASSERT_TRUE(hex.ok()) << hex.status();
    EXPECT_EQ(hex->size(), static_cast<size_t>(n));
    EXPECT_EQ(hex->find_first_not_of("0123456789abcdef"), std::string::npos) << *hex;
  }
  for (int i = 0; i < 100; ++i) seen.insert(RandomHex(64).value());
  EXPECT_EQ(seen.size(), 100u) << "256-bit draws repeated";
  EXPECT_EQ(RandomHex(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SecretTest, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "xbc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
}

TEST(SecretTest, RandomBytesHaveTheAskedLengthAndDifferEveryDraw) {
  EXPECT_EQ(RandomBytes(0).value(), "");
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<std::string> bytes = RandomBytes(32);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    ASSERT_EQ(bytes->size(), 32u);
    seen.insert(*bytes);
  }
  EXPECT_EQ(seen.size(), 100u) << "256-bit draws repeated";
}

std::string FromHex(const std::string& hex) { return absl::HexStringToBytes(hex); }

// RFC 4231 section 4: test cases 1 (a 20-byte key), 2 (a key shorter than the output), 6 (a key
// longer than SHA-256's block, hashed first) and 7 (a long key and a long message).
// FIPS 180-2's examples, and the empty string.
TEST(SecretTest, Sha256MatchesKnownDigests) {
  EXPECT_EQ(absl::BytesToHexString(Sha256("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(absl::BytesToHexString(Sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(
      absl::BytesToHexString(Sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(SecretTest, HmacSha256MatchesTheRfc4231TestVectors) {
  struct Case {
    std::string key;
    std::string message;
    std::string hmac;  // hex
  };
  const std::vector<Case> cases = {
      {std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger than block-size data. "
       "The key needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    absl::StatusOr<std::string> mac = HmacSha256(c.key, c.message);
    ASSERT_TRUE(mac.ok()) << mac.status();
    EXPECT_EQ(mac->size(), kHmacSha256Bytes);
    EXPECT_EQ(absl::BytesToHexString(*mac), c.hmac);
  }
}

// A proof is the HMAC of the length-prefixed fields under the secret, so it changes with every
// field and with where one field ends and the next begins.
TEST(SecretTest, ChallengeProofCoversEveryFieldAndTheirBoundaries) {
  const std::string secret = "challenge-proof-test-secret";
  const std::string proof = ChallengeProof(secret, "label", "ln", "cn", "127.0.0.1:1").value();
  EXPECT_EQ(proof, HmacSha256(secret, FromHex("000000056c6162656c"                // 5, "label"
                                              "000000026c6e"                      // 2, "ln"
                                              "00000002636e"                      // 2, "cn"
                                              "0000000b3132372e302e302e313a31"))  // 11, the address
                       .value());
  std::set<std::string> proofs = {proof};
  for (const std::string& other : {
           ChallengeProof(secret + "x", "label", "ln", "cn", "127.0.0.1:1").value(),
           ChallengeProof(secret, "label2", "ln", "cn", "127.0.0.1:1").value(),
           ChallengeProof(secret, "label", "lm", "cn", "127.0.0.1:1").value(),
           ChallengeProof(secret, "label", "ln", "cm", "127.0.0.1:1").value(),
           ChallengeProof(secret, "label", "ln", "cn", "127.0.0.1:2").value(),
           ChallengeProof(secret, "label", "cn", "ln", "127.0.0.1:1").value(),  // nonces swapped
           ChallengeProof(secret, "labe", "lln", "cn", "127.0.0.1:1").value(),  // a moved boundary
       }) {
    EXPECT_TRUE(proofs.insert(other).second) << "two different challenges share a proof";
  }
}

}  // namespace
}  // namespace sparsebalance::tools
